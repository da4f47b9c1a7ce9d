"""parity's stand-in for SGLang's compiled `sgl_kernel`, on the PYTHONPATH of CPU servers parity starts.

Never installed: see parity/engines/sglang/kernel_standin.py for what it answers and why.
"""

from parity.engines.sglang.kernel_standin import become_standin

become_standin(globals())
