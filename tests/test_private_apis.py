"""Guards on the private torch, Lightning, transformers and multiprocessing APIs the package
relies on (pyproject states the versions the suite ran on; a new one may change them). Each
test names the API it guards and checks both its shape (name, signature, attribute) and the
behaviour the package relies on, so a version where it changes fails here, in one line naming
it, rather than somewhere in a run.

Uses guarded here:

* ``torch.optim.AdamW._init_group`` — overridden by
  :class:`~atp_pipeline.parallel.optim.LocalShardAdamW` (kernels on DTensors' local shards);
* ``multiprocessing.forkserver._forkserver`` (``_forkserver_pid``, ``_stop()``) and
  ``multiprocessing.reduction.DupFd`` — :mod:`atp_pipeline.launch` (prestart, stop, stdio);
* ``torch.utils._python_dispatch.TorchDispatchMode`` — :mod:`atp_pipeline.models.op_count`;
* ``torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather`` /
  ``DefaultReduceScatter`` — :func:`atp_pipeline.parallel.fsdp.counted_collectives`;
* ``nn.Module._parameters`` — styles and the SBP executor put a module's local tensors there;
* Lightning's ``Trainer._accelerator_connector.use_distributed_sampler``,
  ``LightningModule._trainer`` / ``_device_mesh``, ``ModelParallelStrategy._device_mesh`` and
  ``Strategy._precision_plugin`` — :mod:`atp_pipeline.lightning.strategy`; the route of its
  gradient clipping to the precision plugin's ``clip_grad_by_norm`` / ``clip_grad_by_value`` —
  :mod:`atp_pipeline.lightning.precision`;
* transformers' ``config._attn_implementation`` / ``_attn_implementation_internal`` — the HF
  attention style and the layout's probe (:mod:`atp_pipeline.models.hf`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _params(fn) -> list:
    return list(inspect.signature(fn).parameters)


def test_adamw_init_group_is_the_hook_local_shard_adamw_overrides():
    from atp_pipeline.parallel.optim import LocalShardAdamW

    api = "torch.optim.AdamW._init_group (private; overridden by LocalShardAdamW)"
    hook = getattr(torch.optim.AdamW, "_init_group", None)
    assert callable(hook), f"{api} is gone"
    assert _params(hook) == ["self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs",
                             "max_exp_avg_sqs", "state_steps"], f"{api} changed its signature: {_params(hook)}"
    assert _params(LocalShardAdamW._init_group) == _params(hook), f"{api}: the override's signature differs"

    # its role: step() hands the kernels the very lists it filled (a tensor put there in place of
    # the parameter is the one updated)
    class Swap(torch.optim.AdamW):
        def _init_group(self, group, params_with_grad, *rest):
            has_complex = super()._init_group(group, params_with_grad, *rest)
            params_with_grad[0] = shadow
            return has_complex

    for foreach in (True, False):
        p, shadow = nn.Parameter(torch.ones(3)), torch.ones(3)
        p.grad = torch.ones(3)
        Swap([p], lr=0.1, foreach=foreach).step()
        assert torch.equal(p.detach(), torch.ones(3)) and not torch.equal(shadow, torch.ones(3)), \
            f"{api}: the lists it fills no longer reach the kernels (foreach={foreach})"

    calls = []

    class Counted(LocalShardAdamW):
        def _init_group(self, *args):
            has_complex = super()._init_group(*args)
            calls.append(len(args[1]))  # the parameters it collected
            return has_complex

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    before = torch.optim.AdamW([nn.Parameter(torch.ones(3))], lr=0.1, foreach=True)
    before.param_groups[0]["params"][0].grad = torch.ones(3)
    before.step()
    Counted([p], lr=0.1, foreach=True).step()
    assert calls == [1], f"{api}: step() no longer calls it once per group ({calls})"
    assert torch.equal(p.detach(), before.param_groups[0]["params"][0].detach()), \
        f"{api}: LocalShardAdamW on plain tensors differs from torch.optim.AdamW"


_FORKSERVER = r"""
import os
from multiprocessing import forkserver
from atp_pipeline import launch
server = getattr(forkserver, "_forkserver", None)
assert isinstance(server, forkserver.ForkServer), "no ForkServer singleton"
assert hasattr(server, "_forkserver_pid") and callable(getattr(server, "_stop", None)), "no _forkserver_pid / _stop"
assert server._forkserver_pid is None, server._forkserver_pid
launch.PRELOAD[:] = []
launch.prestart()
pid = launch._STARTED[1]
assert launch._STARTED[0] == os.getpid() and pid and pid == server._forkserver_pid, (launch._STARTED, pid)
os.kill(pid, 0)
launch.stop_prestarted()
assert server._forkserver_pid is None, "_stop() did not forget the server"
try:
    os.kill(pid, 0)
except ProcessLookupError:
    print("STOPPED")
"""

_STDIO = r"""
import os, sys
from atp_pipeline import launch
launch.PRELOAD[:] = []
launch.prestart()  # the server starts with this process's stdout: the pipe the test reads
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(out, 1)  # the launch's stdout from now on: the file
launch.spawn(print, 1, "RANK-OUTPUT", init=False, timeout=400)
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ATP_START_METHOD", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_forkserver_internals_the_launcher_reads_and_stops():
    api = "multiprocessing.forkserver._forkserver (_forkserver_pid, _stop(); private, atp_pipeline.launch)"
    r = _python(_FORKSERVER)
    assert r.returncode == 0 and r.stdout.strip().endswith("STOPPED"), \
        f"{api} changed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"


def test_a_rank_writes_where_the_launcher_writes_at_the_launch(tmp_path):
    api = "multiprocessing.reduction.DupFd (undocumented; atp_pipeline.launch._Stdio hands ranks the launcher's stdio)"
    from multiprocessing import reduction

    assert callable(getattr(reduction, "DupFd", None)), f"{api} is gone"
    out = tmp_path / "stdout.txt"
    r = _python(_STDIO, str(out))
    assert r.returncode == 0, f"{api}: the launch failed: {r.stderr.strip().splitlines()[-1:]}"
    assert "0 1 RANK-OUTPUT" in out.read_text() and "RANK-OUTPUT" not in r.stdout, \
        f"{api}: the rank wrote where the fork server's stdout was, not the launcher's"


def test_torch_dispatch_mode_sees_each_aten_kernel():
    api = "torch.utils._python_dispatch.TorchDispatchMode (private module; atp_pipeline.models.op_count)"
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as exc:
        pytest.fail(f"{api} is gone: {exc}")
    from atp_pipeline.models.op_count import pointwise_kernels

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, func.is_view))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.nn.functional.gelu(torch.ones(2, 3) * 2)
    assert ("mul", False) in seen and ("gelu", False) in seen, f"{api}: it no longer sees aten kernels ({seen})"
    assert pointwise_kernels(nn.GELU()) is not None and pointwise_kernels(nn.GELU())[0] == 1, \
        f"{api}: op_count no longer counts one kernel for a GELU"


def test_fsdp_default_collectives_the_counted_ones_subclass():
    api = "torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather/DefaultReduceScatter (private)"
    try:
        mod = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
        gather, scatter = mod.DefaultAllGather, mod.DefaultReduceScatter
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{api} is gone: {exc}")
    assert _params(gather.__call__)[:5] == ["self", "output_tensor", "input_tensor", "group", "async_op"], \
        f"{api}: DefaultAllGather.__call__ changed: {_params(gather.__call__)}"
    assert _params(scatter.__call__)[:6] == ["self", "output_tensor", "input_tensor", "group", "op", "async_op"], \
        f"{api}: DefaultReduceScatter.__call__ changed: {_params(scatter.__call__)}"
    from torch.distributed.fsdp import FSDPModule

    assert callable(getattr(FSDPModule, "set_custom_all_gather", None)) and \
        callable(getattr(FSDPModule, "set_custom_reduce_scatter", None)), \
        f"{api}: FSDP2's custom-collective seam is gone"


def test_module_parameters_dict_holds_what_forward_reads():
    api = "torch.nn.Module._parameters (private; atp_pipeline.parallel.styles/sbp_exec put local tensors there)"
    m = nn.Linear(4, 2)
    assert isinstance(getattr(m, "_parameters", None), dict), f"{api} is gone"
    local = torch.zeros(2, 4)  # a plain tensor, as a style's local shard
    m._parameters["weight"] = local
    assert m.weight is local and dict(m.named_parameters())["weight"] is local, \
        f"{api}: a tensor put there is not what the module's attribute and named_parameters() return"
    assert torch.equal(m(torch.ones(1, 4)), m.bias.detach().unsqueeze(0)), f"{api}: forward does not read it"


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_private_attributes_the_strategy_sets(package):
    pl = importlib.import_module(package)
    model_parallel = importlib.import_module(f"{package}.strategies.model_parallel")
    connector = importlib.import_module(f"{package}.trainer.connectors.data_connector")
    api = f"{package}: Trainer._accelerator_connector.use_distributed_sampler (private; ATPStrategy.setup_environment)"
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(getattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", None),
                      bool), f"{api} is gone"
    assert "_accelerator_connector.use_distributed_sampler" in inspect.getsource(connector), \
        f"{api}: the data connector no longer reads it to decide the sampler injection"
    api = f"{package}: LightningModule._trainer / _device_mesh (private; ATPStrategy.setup_environment)"
    module = pl.LightningModule()
    assert getattr(module, "_trainer", 0) is None, f"{api}: no _trainer attribute on a detached module"
    module._trainer, module._device_mesh = trainer, "mesh"
    assert module.trainer is trainer and module.device_mesh == "mesh", f"{api}: its properties no longer read them"
    api = f"{package}: ModelParallelStrategy._device_mesh (private; ATPStrategy.setup_environment)"
    strategy = model_parallel.ModelParallelStrategy()
    strategy._device_mesh = "mesh"
    assert strategy.device_mesh == "mesh", f"{api}: device_mesh no longer reads it"


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_clipping_reaches_the_strategys_precision_plugin(package):
    """Lightning clips through ``trainer.precision_plugin`` (the strategy's, held in its private
    ``_precision_plugin``) and its ``clip_grad_by_norm`` / ``clip_grad_by_value``, which
    ``ATPStrategy`` mixes the global clipping into."""
    importlib.import_module(package)
    from atp_pipeline.lightning.precision import GlobalClipMixin

    flavor = importlib.import_module("atp_pipeline.lightning.pl" if package == "pytorch_lightning"
                                     else "atp_pipeline.lightning.unified")
    precision = importlib.import_module(f"{package}.plugins.precision")
    api = f"{package}: Strategy._precision_plugin (private; ATPStrategy.precision_plugin)"
    strategy = flavor.ATPStrategy(mesh=(1, 1))
    plugin = precision.MixedPrecision("bf16-mixed", "cpu")
    strategy.precision_plugin = plugin
    assert strategy._precision_plugin is plugin, f"{api}: the setter no longer stores the plugin there"
    got = strategy.precision_plugin
    assert got is plugin and isinstance(got, GlobalClipMixin) and isinstance(got, precision.MixedPrecision), api
    assert type(got).clip_grad_by_norm is GlobalClipMixin.clip_grad_by_norm, api
    api = f"{package}: Precision.clip_gradients -> clip_grad_by_norm / clip_grad_by_value"
    source = inspect.getsource(precision.Precision.clip_gradients)
    assert "self.clip_grad_by_norm(" in source and "self.clip_grad_by_value(" in source, f"{api}: another route"
    module = importlib.import_module(f"{package}.core.module").LightningModule
    assert "self.trainer.precision_plugin.clip_gradients(" in inspect.getsource(module.clip_gradients), \
        f"{package}: LightningModule.clip_gradients no longer calls the trainer's precision plugin"
    import pickle

    again = pickle.loads(pickle.dumps(got))  # pickled as the plugin it was
    assert type(again) is precision.MixedPrecision, type(again)


def test_transformers_attention_implementation_attributes():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    api = ("transformers PretrainedConfig._attn_implementation / _attn_implementation_internal (private; the "
           "hf_attention style and the layout's probe switch a module's attention implementation with them)")
    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
                                   vocab_size=32)
    assert hasattr(cfg, "_attn_implementation_internal"), f"{api} is gone"
    cfg._attn_implementation_internal = "eager"
    assert cfg._attn_implementation == "eager", f"{api}: setting the internal one no longer sets the implementation"
    assert callable(getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)), \
        f"{api}: ALL_ATTENTION_FUNCTIONS.get_interface is gone"
