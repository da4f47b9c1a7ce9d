"""parity's start-up hook for the vLLM servers it launches on a CPU (parity/engines/startup.py).

It changes nothing unless parity's variables are set: then it installs the CPU changes of
parity/engines/vllm/cpu_patches.py in every process vLLM starts (API server, engine core, worker).
"""

import os

from parity.engines.startup import run_shadowed

if os.environ.get("PARITY_VLLM_CPU"):
    from parity.engines.vllm.cpu_patches import install

    install(os.environ)
run_shadowed(__file__)
