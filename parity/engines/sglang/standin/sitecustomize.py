"""parity's start-up hook for the SGLang servers it launches on a CPU (parity/engines/startup.py).

It changes nothing unless parity's variables are set: then it installs the CPU changes of
parity/engines/sglang/cpu_patches.py in every process SGLang starts (launcher, tokenizer,
scheduler, detokenizer).
"""

import os

from parity.engines.startup import run_shadowed

if os.environ.get("PARITY_SGLANG_CPU"):
    from parity.engines.sglang.cpu_patches import install

    install(os.environ)
run_shadowed(__file__)
