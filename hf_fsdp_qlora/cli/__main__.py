"""`python -m hf_fsdp_qlora.cli COMMAND ...`: the `hf-fsdp-qlora` command without its console script."""

import sys

from hf_fsdp_qlora.cli.main import main

sys.exit(main())
