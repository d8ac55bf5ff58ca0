"""`hf-fsdp-qlora export-gguf`: a merged model, or a LoRA adapter, as GGUF for llama.cpp, through llama.cpp's own
converters (:func:`hf_fsdp_qlora.merge.gguf.export_gguf`). The converter is read at the command line's edge from
--llama-cpp or HF_FSDP_QLORA_LLAMA_CPP."""

from __future__ import annotations

import argparse
import os
import sys

from hf_fsdp_qlora.cli._command import Command, CommandError
from hf_fsdp_qlora.cli._options import add_adapter_config

__all__ = ["LLAMA_CPP_ENV", "ExportGgufCommand"]

LLAMA_CPP_ENV = "HF_FSDP_QLORA_LLAMA_CPP"


class ExportGgufCommand(Command):
    name = "export-gguf"
    help = "merged model or LoRA adapter -> GGUF (llama.cpp's converter)"
    description = (
        "Write a GGUF file for llama.cpp: of a merged model folder, or with --adapter, a GGUF LoRA adapter for that "
        "model as its base. The conversion is llama.cpp's own convert_hf_to_gguf.py / convert_lora_to_gguf.py, run "
        "with this Python."
    )
    epilog = f"""\
--llama-cpp (or ${LLAMA_CPP_ENV}) is a llama.cpp checkout or the llama-cpp-python sdist, which carries both
converters: pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d DIR

examples:
  merge-adapters --base ./base --adapter ./run/checkpoint-500 --output ./merged
  hf-fsdp-qlora export-gguf ./merged --output merged.gguf --llama-cpp DIR/llama_cpp_python-0.3.36.tar.gz
  hf-fsdp-qlora export-gguf ./base --adapter ./run/checkpoint-500 --output lora.gguf --llama-cpp ./llama.cpp

Expert LoRA (peft target_parameters), DoRA, rsLoRA, alpha_pattern, modules_to_save and LoRA on embeddings have
no GGUF adapter form that llama.cpp computes as peft does: they are refused; merge first and export the merge.

exit status: 0 written, 1 the converter failed, 2 usage error (bad option or path, no converter, an adapter or
tokenizer llama.cpp cannot convert).
"""
    writes_output = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "model", metavar="MODEL", help="model folder (merge-adapters' output; with --adapter: the adapter's base)"
        )
        parser.add_argument("--output", required=True, metavar="FILE.gguf", help="the GGUF file to write")
        parser.add_argument(
            "--adapter",
            default=None,
            metavar="PATH",
            help="write a GGUF LoRA adapter instead: a peft adapter folder, Trainer checkpoint or FSDP sharded "
            "checkpoint trained on MODEL",
        )
        add_adapter_config(parser)
        parser.add_argument(
            "--llama-cpp",
            default=None,
            metavar="PATH",
            help=f"llama.cpp checkout, llama-cpp-python sdist (.tar.gz) or that sdist unpacked (default: ${LLAMA_CPP_ENV})",
        )
        parser.add_argument(
            "--outtype",
            choices=["f32", "f16", "bf16", "q8_0", "auto"],
            default="f32",
            help="GGUF tensor type, as the converters name it (default: f32, the merged values exactly)",
        )
        parser.add_argument("--force", action="store_true", help="replace an existing --output file")

    def run(self, args: argparse.Namespace) -> int:
        from hf_fsdp_qlora.merge.gguf import SDIST_HINT, export_gguf

        llama_cpp = args.llama_cpp or os.environ.get(LLAMA_CPP_ENV)
        if not llama_cpp:
            raise CommandError(
                f"no llama.cpp converter given: pass --llama-cpp PATH or set {LLAMA_CPP_ENV}. {SDIST_HINT}"
            )
        result = export_gguf(
            args.model,
            args.output,
            llama_cpp=llama_cpp,
            adapter=args.adapter,
            adapter_config=args.adapter_config,
            outtype=args.outtype,
            force=args.force,
            on_note=lambda note: print(f"{self.prog}: warning: {note}", file=sys.stderr),
        )
        print(f"GGUF {result.kind} written to {result.path}")
        return 0
