"""loadtest.busy_neighbour on the tiny model: both settings run in their own processes, alone
and beside a real busy process, and are summarized."""

import json

from loadtest import busy_neighbour


def test_both_settings_run_alone_and_beside_the_neighbour(tmp_path):
    out = tmp_path / "neighbour.json"
    assert busy_neighbour.main(["--pairs", "1", "--tokens", "6", "--requests", "3",
                                "--settle-s", "0.5", "--set", "model.name=dummy:tiny",
                                "--set", "model.num_threads=2",
                                "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"on", "off"}
    for arm in ("on", "off"):
        [run] = result["runs"][arm]
        for phase in ("alone", "neighbour"):
            for metric in ("ttft_ms", "tpot_ms", "tok_s"):
                assert run[phase][metric] > 0, (arm, phase, metric)
                assert result["summary"][arm][f"{phase}_{metric}"]["median"] \
                    == run[phase][metric]
    # Off, the engine never sets a count of its own; on, it runs at most the two it was given.
    assert result["runs"]["off"][0]["threads_beside_neighbour"] is None
    assert result["runs"]["on"][0]["threads_beside_neighbour"] in (1, 2)
