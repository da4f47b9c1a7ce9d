"""Deterministic images and videos, user images, videos and audio clips: what a request shows the model.
May import the base modules of parity/ (errors, textfiles, data) only."""
