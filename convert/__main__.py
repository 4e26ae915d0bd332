"""python -m convert --src HF_DIR --dst OUT_DIR [--dtype bfloat16] [--overwrite] [--verify]"""

import argparse
import sys

from convert.converter import convert_checkpoint
from convert.reader import CheckpointError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert",
                                     description="Convert a K3 / Kimi Linear safetensors checkpoint to Orbax.")
    parser.add_argument("--src", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dst", required=True, help="output directory (written atomically)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    parser.add_argument("--verify", action="store_true", help="re-read the output and compare checksums")
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, verify=args.verify)
    except (CheckpointError, FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
