"""Tests of convert/: safetensors reading, the layout table, MXFP4, conversion to Orbax and loading."""
