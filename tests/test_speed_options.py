"""The speed options of FSDPQLoRATrainingArguments (issue 15): compile_layers and activation_offloading.

One 2-rank FSDP2 launch (CPU rehearsal config) trains the tiny Llama three times from the same seed and data:
without options, with activation offloading, with per-layer compilation. Oracle: the run without options.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import accelerate_launch, check, read_results
from tiny_models import build_tiny_model

LAYERS = 2  # tiny_config's decoder layers


@pytest.fixture(scope="module")
def speed_runs(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / "llama", "llama")
    out = tmp_path_factory.mktemp("speed")
    proc = accelerate_launch("cpu_fsdp2_rehearsal.yaml", "speed_options.py", "--models", str(models), "--out",
                             str(out), timeout=400)  # fmt: skip
    check(proc)
    results = read_results(out)
    assert set(results) == {0, 1}
    for rank, found in results.items():
        for name, run in found.items():
            assert "error" not in run, (rank, name, run.get("error"))
            assert run["distributed_type"].endswith("FSDP") and run["engaged"]["fsdp2_modules"] > 0, (name, run)
            assert run["engaged"]["dtensor_params"] > 0, (name, run)
    return out, results


@pytest.mark.distributed
def test_compiled_layers_train_like_uncompiled(speed_runs):
    out, results = speed_runs
    for rank, found in results.items():
        base, compiled = found["base"], found["compile"]
        assert base["compiled"] == [] and base["losses"], base
        layers = [n for n in compiled["compiled"] if n.rsplit(".", 2)[-2:-1] == ["layers"]]
        assert len(layers) == LAYERS, compiled["compiled"]  # every decoder layer compiled in place
        assert compiled["dynamo"].get("unique_graphs", 0) >= 1, compiled["dynamo"]  # and really traced by dynamo
        # Within bf16 rounding (measured: equal bit for bit on this CPU).
        assert compiled["losses"] == pytest.approx(base["losses"], rel=1e-2), (compiled["losses"], base["losses"])
        got = torch.load(out / f"logits_compile_rank{rank}.pt")
        expected = torch.load(out / f"logits_base_rank{rank}.pt")
        torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.distributed
def test_frozen_embedding_is_gathered_once_per_step(speed_runs):
    """FSDP2 used to all-gather the frozen embedding again in the backward (layer 0's prefetch), for nothing."""
    out, results = speed_runs
    for rank, found in results.items():
        base, regather = found["base"], found["regather"]
        embed = "base_model.model.model.embed_tokens"
        steps = len(base["losses"])
        assert steps == 2, base
        assert base["gathers"][f"{embed}|forward"] == steps, base["gathers"]
        assert base["gathers"].get(f"{embed}|backward", 0) == 0, base["gathers"]
        # The counter sees backward gathers (the layers'), and the old behaviour's extra one per step ...
        assert any(k.endswith("|backward") for k in base["gathers"]), base["gathers"]
        assert regather["gathers"][f"{embed}|backward"] == steps, regather["gathers"]
        # ... whose removal changes no bit: the old behaviour is the oracle.
        assert base["losses"] == regather["losses"], (base["losses"], regather["losses"])
        base_logits = torch.load(out / f"logits_base_rank{rank}.pt")
        torch.testing.assert_close(base_logits, torch.load(out / f"logits_regather_rank{rank}.pt"), rtol=0, atol=0)


@pytest.mark.distributed
def test_activation_offloading_is_an_engaged_no_op_on_cpu(speed_runs):
    out, results = speed_runs
    for rank, found in results.items():
        base, offload = found["base"], found["offload"]
        assert "offload" not in base  # not installed unless asked
        assert offload["offload"]["packed"] > 0, offload  # the hooks saw the saved tensors ...
        assert offload["offload"]["offloaded"] == 0, offload  # ... and left host tensors where they were
        assert offload["losses"] == base["losses"]
        got = torch.load(out / f"logits_offload_rank{rank}.pt")
        assert torch.equal(got, torch.load(out / f"logits_base_rank{rank}.pt"))


def test_offloading_hooks_hand_back_the_same_tensors_and_gradients():
    from hf_fsdp_qlora.train.offload import ActivationOffloading

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64, requires_grad=True)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    hooks = ActivationOffloading(min_bytes=0)
    with hooks:
        y = layer(x).square().sum()
    y.backward()
    got = [p.grad for p in layer.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert hooks.packed > 0 and hooks.offloaded == 0 and hooks.offloaded_bytes == 0
    assert hooks._pack(x) is x  # identity for host tensors
    assert hooks._unpack(x) is x


def _single_process_trainer(tmp_path, **options):
    from tiny_models import build_tiny_model as build

    import hf_fsdp_qlora  # noqa: F401
    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model

    path = build(tmp_path / "llama", "llama")
    model = load_qlora_model(str(path))
    args = FSDPQLoRATrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, use_cpu=True, report_to=[],
                                      save_strategy="no", **options)  # fmt: skip
    data = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 4
    return FSDPQLoRATrainer(model=model, args=args, train_dataset=data)


def test_compile_layers_refuses_without_fsdp2(tmp_path):
    from hf_fsdp_qlora import UnsupportedSetupError

    with pytest.raises(
        UnsupportedSetupError, match=r"compile_layers=True is supported under FSDP2 only.*fsdp_version: 2"
    ):
        _single_process_trainer(tmp_path, compile_layers=True)


def test_compile_layers_refuses_on_cpu_without_a_cpp_compiler(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    import hf_fsdp_qlora.train.compile as compile_mod
    from hf_fsdp_qlora import UnsupportedSetupError

    plugin = TorchDynamoPlugin(backend="no")
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2), dynamo_plugin=plugin)
    trainer = SimpleNamespace(args=SimpleNamespace(compile_layers=True), is_fsdp_enabled=True,
                              accelerator=SimpleNamespace(state=state, device=torch.device("cpu")))  # fmt: skip
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(UnsupportedSetupError, match="needs a C\\+\\+ compiler.*apt-get install g\\+\\+"):
        compile_mod.enable_layer_compilation(trainer)
    assert plugin.use_regional_compilation is False
    monkeypatch.delenv("CXX")
    assert compile_mod.enable_layer_compilation(trainer) is True  # g++ is on this machine's PATH
    assert plugin.backend == DynamoBackend.INDUCTOR and plugin.use_regional_compilation is True


def test_offloading_option_installs_the_hooks_once(tmp_path):
    trainer = _single_process_trainer(tmp_path, activation_offloading=True)
    from hf_fsdp_qlora.train.offload import install_activation_offloading

    hooks = trainer.model._hf_fsdp_qlora_offloading
    assert install_activation_offloading(trainer.model) is hooks
    trainer.train()
    assert hooks.packed > 0 and hooks.offloaded == 0


def test_memory_plan_moves_offloaded_activations_to_host():
    from tiny_models import tiny_config

    from hf_fsdp_qlora.doctor import diagnose

    config = tiny_config("llama")
    common = {"quantization": "4bit", "seq_len": 4096, "batch_size": 2, "num_gpus": 1}
    for checkpointing in (True, False):
        settings = dict(common, gradient_checkpointing=checkpointing)
        plain = diagnose(config, **settings).plan
        assert plain.checkpointing == ("trainer" if checkpointing else "none")
        offloaded = diagnose(config, activation_offloading=True, **settings).plan
        moved = offloaded.host["activations_offloaded"]
        assert moved > 0 and "activations_offloaded" not in plain.host
        assert offloaded.parts["activations"] == plain.parts["activations"] - moved
        assert offloaded.total == plain.total - moved
        # Every other term is unchanged: only the saved activations move.
        assert {k: v for k, v in offloaded.parts.items() if k != "activations"} == {
            k: v for k, v in plain.parts.items() if k != "activations"
        }
    # Without checkpointing most of the activations are saved outside any checkpoint: the larger move.
    off_ckpt = diagnose(config, activation_offloading=True, gradient_checkpointing=True, **common).plan
    off_none = diagnose(config, activation_offloading=True, **{**common, "gradient_checkpointing": False}).plan
    assert off_none.host["activations_offloaded"] > off_ckpt.host["activations_offloaded"]


def test_doctor_cli_activation_offloading_flag(capsys, tmp_path):
    """`hf-fsdp-qlora doctor --activation-offloading` plans the same move as the Python option."""
    import json

    from tiny_models import tiny_config

    from hf_fsdp_qlora.cli.main import main as cli_main

    tiny_config("llama").save_pretrained(tmp_path)
    model = str(tmp_path / "config.json")

    def plan(*extra):
        code = cli_main(["doctor", "--accelerate-config", "fsdp2_qlora", "--model", model, "--load-in-4bit", "--seq-len", "4096", "--json", *extra])
        assert code in (0, 1)
        return json.loads(capsys.readouterr().out)["memory"]

    plain, offloaded = plan(), plan("--activation-offloading")
    moved = offloaded["host_per_process"]["activations_offloaded"]
    assert moved > 0 and "activations_offloaded" not in plain["host_per_process"]
    assert offloaded["per_gpu"]["activations"] == plain["per_gpu"]["activations"] - moved
    cli_main(["doctor", "--accelerate-config", "fsdp2_qlora", "--model", model, "--load-in-4bit", "--activation-offloading"])
    assert "activations offloaded to host RAM per process" in capsys.readouterr().out


_SELECTION = """
import json, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from hf_fsdp_qlora.train.fsdp import skip_frozen_embedding_backward_gather
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen, self.trained, self.linear = torch.nn.Embedding(8, 4), torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4)

    def forward(self, ids):
        return self.linear(self.frozen(ids) + self.trained(ids))

model = Model()
model.frozen.requires_grad_(False)
model.linear.requires_grad_(False)
for name in ("frozen", "trained", "linear"):
    fully_shard(getattr(model, name), mesh=mesh)
fully_shard(model, mesh=mesh)
changed = skip_frozen_embedding_backward_gather(model)
flags = {n: m._get_fsdp_state()._fsdp_param_groups[0].unshard_in_backward for n, m in model.named_children()}
print(json.dumps({"changed": changed, "flags": flags}), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's teardown at interpreter exit sometimes aborts even after destroy (dist_utils.exit_worker)
"""


def test_only_frozen_embedding_units_skip_the_backward_gather(tmp_path):
    """A trainable embedding needs its weight in the backward, a frozen Linear for its input gradient. One process
    (a 1-rank torchrun, forked from the fork server: no fresh imports of the stack)."""
    import json

    from dist_utils import torchrun

    script = tmp_path / "selection.py"
    script.write_text(_SELECTION)
    proc = torchrun(str(script), nproc=1, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["changed"] == ["frozen"], found
    assert found["flags"] == {"frozen": False, "trained": True, "linear": True}, found
