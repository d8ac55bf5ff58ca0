"""``python -m hf_fsdp_qlora.run SCRIPT.py ARGS`` (or ``-m MODULE``): run an unchanged training script with our behaviour.

The launcher lives in :mod:`hf_fsdp_qlora.train.launcher`; this module is its ``-m`` entry point.
"""

from .train.launcher import main

if __name__ == "__main__":
    main()
