"""What every engine backend (SGLang, vLLM) shares: real servers per execution mode and a tap inside them.

- `launcher`: server processes (free loopback port, own process group, readiness, group stop).
- `placement`: which GPUs and how much memory each mode's server gets, and the start order.
- `flags`: reading the user's pass-through engine flags as argparse would.
- `channel`: the folder parity steers a tap through, and the records the tap writes (one per LM entry).
- `evidence`: an arm's evidence from those records.
- `http`: JSON over HTTP to a server.
- `prompts`: the checkpoint's chat template and config, and fixtures as PNG files.
- `gpus`: what nvidia-smi says about the GPUs.

Nothing is imported here: an engine imports `parity.engines.channel` in its model processes, and
that must stay cheap.
"""
