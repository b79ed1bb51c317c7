"""The control plane stays light: admission, priority and batcher never import torch (nor the
executor's engine), so they start in a fraction of a second and fit in small containers."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "services.executor.engine")


@pytest.mark.parametrize("module", ["services.admission.service", "services.priority.service",
                                    "services.batcher.service"])
def test_a_control_plane_service_imports_no_torch(module):
    probe = (f"import sys, {module}; "
             f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"{module} imported {out}"
