"""Audio clips for models that take audio (`--audio`): a built-in tone sweep and WAV files.

Audio reaches Qwen3-Omni's thinker through its audio tower into the audio rows of the prompt; it
carries no DeepStack, so a request whose only media is audio has nothing for the experiment to
prove (design §12). A clip is identified by the sha256 of its samples (float32, mono, at the
model's rate) after that rate.
"""

from __future__ import annotations

import hashlib
import io
import os
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity.errors import UsageError
from parity.textfiles import user_bytes

RATE = 16000  # what the Omni thinker's feature extractor takes
MAX_SECONDS = 30.0
# 30 s of 32-bit PCM at 192 kHz in 8 channels is 184 MB: a larger file is no clip parity reads.
MAX_AUDIO_BYTES = 256 * 2**20


@dataclass(frozen=True, eq=False)
class AudioClip:
    name: str
    samples: np.ndarray  # [n] float32 in [-1, 1], mono, at RATE

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256(f"audio {RATE} Hz\n".encode())
        digest.update(np.ascontiguousarray(self.samples, dtype="<f4").tobytes())
        return digest.hexdigest()

    @property
    def seconds(self) -> float:
        return len(self.samples) / RATE


def _tone() -> np.ndarray:
    """One second rising from 220 to 660 Hz at half scale (float32 arithmetic: the same everywhere)."""
    t = np.arange(RATE, dtype=np.float64) / RATE
    return (0.5 * np.sin(2 * np.pi * (220 * t + 220 * t * t))).astype(np.float32)


BUILTIN = {"audio-tone": _tone}


def audio_clip(given: str) -> AudioClip:
    """`--audio`: a built-in clip by name, or a WAV file (PCM 8/16/32-bit, any rate and channels:
    mixed to mono and resampled linearly to the model's rate)."""
    if given in BUILTIN and not Path(given).exists():
        return AudioClip(given, BUILTIN[given]())
    if str(given).strip() and not os.path.lexists(given):
        raise UsageError(f"--audio {given}: no such file, and not a built-in clip ({', '.join(BUILTIN)})")
    data = user_bytes("--audio", given, MAX_AUDIO_BYTES)
    path = Path(given)
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            width, channels, rate, frames = wav.getsampwidth(), wav.getnchannels(), wav.getframerate(), wav.getnframes()
            if frames > MAX_SECONDS * rate:
                raise UsageError(f"--audio {given}: {frames / rate:.1f} s, longer than the {MAX_SECONDS:.0f} s parity takes")
            raw = wav.readframes(frames)
    except (wave.Error, EOFError) as err:
        raise UsageError(f"--audio {given}: not a PCM WAV file ({err})") from None
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}
    if width not in kinds:
        raise UsageError(f"--audio {given}: {8 * width}-bit samples; parity reads 8, 16 or 32-bit PCM")
    dtype, offset, scale = kinds[width]
    samples = (np.frombuffer(raw, dtype=dtype).astype(np.float64) - offset) / scale
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != RATE and len(samples):
        grid = np.arange(int(round(len(samples) * RATE / rate))) * rate / RATE
        samples = np.interp(grid, np.arange(len(samples)), samples)
    if not len(samples):
        raise UsageError(f"--audio {given}: no samples")
    return AudioClip(path.stem, samples.astype(np.float32))
