"""Training under FSDP: the trainers, the callback (one implementation for every route), the Trainer hook, the
pre-wrap consistency pass, FSDP plugin configuration and engagement check, gathered adapter and optimizer
checkpoints, training arguments, hygiene callbacks, generation and evaluation under FSDP, and the
``python -m hf_fsdp_qlora.run`` launcher.

The public names are exported from :mod:`hf_fsdp_qlora`; import them from there.
"""
