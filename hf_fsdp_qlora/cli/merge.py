"""`merge-adapters` / `hf-fsdp-qlora merge`: merge a LoRA adapter into its 16-bit base, streamed.

The work is :func:`hf_fsdp_qlora.merge.merge_adapters`; this module only declares the options and passes
them on. torch is imported in `run`, so `--help` is instant.
"""

from __future__ import annotations

import argparse

from hf_fsdp_qlora.cli._command import Command
from hf_fsdp_qlora.cli._options import FLOAT_DTYPES, add_adapter_config, add_force, add_output, dtype_type

__all__ = ["MergeCommand"]


class MergeCommand(Command):
    name = "merge"
    help = "merge a LoRA adapter into its 16-bit base"
    description = "Merge a LoRA adapter into its 16-bit base model and write a plain, sharded safetensors model."
    epilog = """\
The base is read one tensor at a time and every update is computed in float32 and cast once, so peak
memory is about the largest tensor, not the model. The output appears only when complete; with --force
the old output is kept until then. --force replaces only an earlier output of this tool; an --output that
is, contains or lies inside --base or --adapter (symlinks and .. resolved) is always refused.

example:
  merge-adapters --base ./Llama-3.1-8B --adapter ./run/checkpoint-500 --output ./merged --dtype bfloat16

exit status: 0 merged, 1 the merge failed (adapter does not fit the base, corrupted file, full disk),
2 usage error (bad option, missing path, existing output without --force, an output that may not be
replaced, no CUDA for --device cuda).
"""
    writes_output = True

    @property
    def prog(self) -> str:
        # Its errors carry the console script's name under both spellings, as users and scripts know it.
        return "merge-adapters"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--base", required=True, metavar="PATH", help="16-bit base model folder (safetensors)")
        parser.add_argument(
            "--adapter",
            required=True,
            metavar="PATH",
            help="peft adapter folder, Trainer checkpoint folder, or FSDP sharded checkpoint (pytorch_model_fsdp_0)",
        )
        add_output(parser, "the merged model")
        parser.add_argument(
            "--dtype",
            type=dtype_type(),
            choices=FLOAT_DTYPES,
            default=None,
            help="dtype of the merged floating-point tensors (default: the base's own dtype)",
        )
        parser.add_argument(
            "--max-shard-size",
            default="5GB",
            metavar="SIZE",
            help="largest output shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)",
        )
        parser.add_argument(
            "--device", default="cpu", help="where the updates are computed: cpu or cuda[:N] (default: cpu)"
        )
        add_force(parser)
        add_adapter_config(parser)
        parser.add_argument(
            "--allow-other-base",
            action="store_true",
            help="merge even though adapter_config.json names a local model of another architecture than --base",
        )
        parser.add_argument(
            "--dequantize",
            choices=["nf4", "fp4", "int8"],
            default=None,
            help="merge onto the quantization round trip of the base that training saw: nf4 / fp4 (the "
            "bnb_4bit_quant_type of QLoRA) or int8 (load_in_8bit) (default: merge onto the 16-bit base as is)",
        )
        parser.add_argument(
            "--double-quant",
            dest="double_quant",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="with --dequantize nf4/fp4: whether training used bnb_4bit_use_double_quant. The adapter's "
            "quantization record (saved by load_qlora_model and this package's trainers) or a pre-quantized base "
            "named in adapter_config.json decides; without either, one of the two is required "
            "(--no-double-quant for BitsAndBytesConfig's default and trl's --load_in_4bit)",
        )
        parser.add_argument(
            "--quant-blocksize",
            type=int,
            default=None,
            help="with --dequantize nf4/fp4: the 4-bit block size of training (default: the record's, else 64)",
        )
        parser.add_argument(
            "--no-dequantize-experts",
            dest="dequantize_experts",
            action="store_false",
            help="with --dequantize nf4/fp4 on a mixture of experts: training kept the experts in 16 bits "
            "(quantize_experts=False); default: the experts are round-tripped expert by expert as well",
        )
        parser.add_argument(
            "--skip-modules",
            nargs="+",
            default=[],
            metavar="NAME",
            help="with --dequantize: layers training kept 16-bit beside transformers' own (load_qlora_model's "
            "skip_modules, e.g. down_proj), merged onto the 16-bit base as is (default: none)",
        )
        parser.add_argument(
            "--untie-embeddings",
            action="store_true",
            help="if the adapter changes only one side of tied input/output embeddings, write both "
            "(tie_word_embeddings=false) instead of failing (default: fail)",
        )
        parser.add_argument(
            "--tokenizer",
            default=None,
            metavar="PATH",
            help="folder whose tokenizer files to write beside the merge, instead of those of --base and of the "
            "adapter folder (default: those, the adapter folder's over the base's); engines such as vLLM refuse a "
            "model folder without tokenizer files",
        )
        parser.add_argument(
            "--no-progress", dest="progress", action="store_false", help="hide the per-shard progress bars"
        )

    def run(self, args: argparse.Namespace) -> int:
        from hf_fsdp_qlora.merge import merge_adapters

        output = merge_adapters(
            args.base,
            args.adapter,
            args.output,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            device=args.device,
            force=args.force,
            dequantize=args.dequantize,
            double_quant=args.double_quant,
            quant_blocksize=args.quant_blocksize,
            dequantize_experts=args.dequantize_experts,
            skip_modules=args.skip_modules,
            untie_embeddings=args.untie_embeddings,
            adapter_config=args.adapter_config,
            allow_other_base=args.allow_other_base,
            tokenizer=args.tokenizer,
            progress=args.progress,
        )
        print(f"merged model written to {output}")
        return 0
