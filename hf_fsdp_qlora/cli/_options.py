"""Options that several commands take, each defined (and its help written) once."""

from __future__ import annotations

import argparse

from hf_fsdp_qlora.dtype_names import FLOAT_NAMES, canonical_name

__all__ = ["FLOAT_DTYPES", "add_adapter_config", "add_force", "add_output", "dtype_type"]

FLOAT_DTYPES = FLOAT_NAMES


def dtype_type(allowed: tuple[str, ...] = FLOAT_DTYPES):
    """An argparse `type` that turns bf16/torch.bfloat16/... into the canonical name, refusing others."""

    def parse(value: str) -> str:
        name = canonical_name(value)
        if name not in allowed:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {value!r}: use {', '.join(allowed[:-1])} or {allowed[-1]}"
            )
        return name

    return parse


def add_output(parser: argparse.ArgumentParser, what: str, metavar: str = "PATH") -> None:
    parser.add_argument(
        "--output",
        required=True,
        metavar=metavar,
        help=f"folder to create for {what}; it may not be, contain or lie inside an input",
    )


def add_force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --output that an earlier merge-adapters or convert wrote and that holds nothing "
        "else (kept until the new one is complete); any other folder is left alone",
    )


def add_adapter_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter-config",
        default=None,
        metavar="PATH",
        help="adapter_config.json of the run, for an FSDP sharded checkpoint saved without one "
        "(default: the one beside the checkpoint)",
    )
