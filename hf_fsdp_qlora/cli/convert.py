"""`hf-fsdp-qlora convert`: turn an FSDP sharded checkpoint into a plain peft adapter folder.

Reads the `.distcp` files with torch.distributed.checkpoint (no process group, one process), keeps only
the trained tensors, and writes `adapter_model.safetensors` + `adapter_config.json` that
`PeftModel.from_pretrained` and `merge-adapters` load. torch is imported in `run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_fsdp_qlora.cli._command import Command, CommandError
from hf_fsdp_qlora.cli._options import add_adapter_config, add_force, add_output

__all__ = ["ConvertCommand"]


class ConvertCommand(Command):
    name = "convert"
    help = "FSDP sharded checkpoint -> peft adapter folder"
    description = "Convert an FSDP sharded checkpoint (.distcp) into a plain peft adapter folder."
    epilog = """\
CHECKPOINT is a Trainer checkpoint folder holding pytorch_model_fsdp_0/, or that folder itself. The
adapter_config.json is taken from beside it (the checkpoint folder or its parents) unless given.

example:
  hf-fsdp-qlora convert ./run/checkpoint-500 --output ./adapter-500

exit status: 0 converted, 1 the checkpoint could not be read, 2 usage error.
"""
    writes_output = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", metavar="CHECKPOINT", help="FSDP checkpoint folder (with .distcp files)")
        add_output(parser, "the peft adapter", metavar="ADAPTER_DIR")
        add_adapter_config(parser)
        add_force(parser)

    def run(self, args: argparse.Namespace) -> int:
        from hf_fsdp_qlora.merge.adapter_io import find_distcp_dir, load_adapter, write_adapter_files
        from hf_fsdp_qlora.merge.output_dir import AtomicOutputDir, check_output

        checkpoint = Path(args.checkpoint)
        if not checkpoint.is_dir() or find_distcp_dir(checkpoint) is None:
            raise CommandError(
                f"{checkpoint} is not an FSDP sharded checkpoint (no .metadata and .distcp files in it or in a "
                "pytorch_model_fsdp_* folder under it)"
            )
        # The checkpoint (its .distcp shards, optimizer and trainer state) and the adapter config are inputs:
        # an output that overlaps them is refused before anything is read or written.
        inputs = [("CHECKPOINT", checkpoint)]
        if args.adapter_config is not None:
            inputs.append(("--adapter-config", args.adapter_config))
        output = check_output(args.output, inputs, args.force)
        adapter = load_adapter(checkpoint, config_path=args.adapter_config, fsdp_only=True)
        with AtomicOutputDir(output, "convert") as tmp:
            write_adapter_files(adapter, tmp)
        print(f"adapter with {len(adapter.tensors)} tensors written to {output}")
        return 0
