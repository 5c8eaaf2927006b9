"""Guards for the few places gentrain relies on a library's private API.

Each test checks the exact private thing one gentrain module uses and fails with a message
naming that module and what to change, so an upgrade of torch, TorchX or torchmetrics that
removes it fails here first rather than silently in a run. The behaviour each use gives is
tested end to end elsewhere (named in each test).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO
from torch import nn

from trainer.engine.shard import move_buffers


def _guard(ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(f"private API gone after an upgrade: {what}", pytrace=False)


def test_torchrun_agent_restart_counter():
    """trainer/launch.py sets LocalElasticAgent._remaining_restarts to 0 when a worker exits 2.

    torchrun has no public way to say "this failure is not worth a restart" (the fail-fast RFC,
    pytorch/pytorch#99051, was closed unmerged). End to end: test_deploy.py's launch test.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from trainer.launch import _agent_that_never_retries_usage_errors

    run_loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    _guard(
        "self._remaining_restarts > 0" in run_loop and "_restart_workers" in run_loop,
        "torch's SimpleElasticAgent._invoke_run no longer restarts while self._remaining_restarts > 0; "
        "trainer/launch.py's UsageErrorsFailFast must find another way to stop restarts on exit code 2",
    )
    agent_cls = _agent_that_never_retries_usage_errors()
    _guard(
        "_monitor_workers" in vars(agent_cls.__mro__[1]),
        "LocalElasticAgent no longer defines _monitor_workers, which trainer/launch.py overrides",
    )
    spec = WorkerSpec(role="probe", local_world_size=1, rdzv_handler=None, entrypoint="true", max_restarts=3)
    agent = agent_cls(spec, logs_specs=DefaultLogsSpecs())
    _guard(
        getattr(agent, "_remaining_restarts", None) == 3,
        "LocalElasticAgent no longer keeps its restart budget in _remaining_restarts (trainer/launch.py)",
    )


def test_torchx_kubernetes_scheduler_builds_volcano_jobs_through_app_to_resource():
    """components/train.py wraps torchx.schedulers.kubernetes_scheduler.app_to_resource to add
    Volcano policies for exit code 2. TorchX has no public hook for Volcano task policies (its
    scheduler options cover queue, service account and priority class only). End to end:
    test_deploy.py's dry-run tests of the Volcano Job."""
    ks = pytest.importorskip("torchx.schedulers.kubernetes_scheduler")
    _guard(
        callable(getattr(ks, "app_to_resource", None)),
        "torchx.schedulers.kubernetes_scheduler.app_to_resource is gone; components/train.py's exit-code "
        "policy patch has nothing to wrap",
    )
    dryrun = inspect.getsource(ks.KubernetesScheduler._submit_dryrun)
    _guard(
        "app_to_resource(" in dryrun,
        "KubernetesScheduler._submit_dryrun no longer calls the module-level app_to_resource, so "
        "components/train.py's patch would not be used",
    )
    params = list(inspect.signature(ks.app_to_resource).parameters)
    _guard(params[:1] == ["app"], f"app_to_resource's first parameter is no longer the AppDef: {params}")


def test_tensor_version_counter_counts_in_place_writes():
    """trainer/checkpoint/writer.py compares Tensor._version before and after copying a tensor for an
    async snapshot, to catch an in-place update that skipped the fence. The version counter is what
    autograd uses for the same check; torch exposes it only as `_version`. End to end:
    test_async_snapshot.py's "changed while it was being copied" test."""
    t = torch.zeros(4)
    _guard(isinstance(getattr(t, "_version", None), int), "torch.Tensor has no integer _version any more")
    before = t._version
    t.add_(1)
    t[0] = 2
    _guard(t._version == before + 2, "Tensor._version no longer counts each in-place write")
    v = t.view(2, 2)
    v.mul_(3)
    _guard(t._version == before + 3, "Tensor._version no longer counts in-place writes through a view")


def test_torchmetrics_kid_keeps_features_in_list_states():
    """trainer/eval/fid.py joins KernelInceptionDistance's `real_features`/`fake_features` list states
    into one tensor each before compute, so every rank issues the same gathers whatever it saw.
    torchmetrics offers no public way to merge list states. End to end: test_eval.py."""
    from torchmetrics.image.kid import KernelInceptionDistance

    class Flat(nn.Module):
        num_features = 6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)[:, :6].double()

    kid = KernelInceptionDistance(feature=Flat(), subset_size=3, reset_real_features=False)
    g = torch.Generator().manual_seed(0)
    for real in (True, False):
        for _ in range(2):
            kid.update(torch.rand(3, 1, 2, 3, generator=g), real=real)
    for name in ("real_features", "fake_features"):
        _guard(
            isinstance(getattr(kid, name, None), list) and name in kid._defaults,
            f"KernelInceptionDistance.{name} is no longer a list state (trainer/eval/fid.py)",
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        as_lists = [float(v) for v in kid.compute()]
    for name in ("real_features", "fake_features"):
        setattr(kid, name, [torch.cat(getattr(kid, name))])
    kid._computed = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        joined = [float(v) for v in kid.compute()]
    _guard(as_lists == joined, "KID computed on joined feature lists differs from KID on the lists torchmetrics kept")


def test_move_buffers_moves_buffers_only_and_keeps_persistence():
    """trainer/engine/shard.py moves an offloaded part's buffers (not its parameters) to the GPU."""
    m = nn.BatchNorm1d(3)
    m.register_buffer("scratch", torch.ones(2), persistent=False)
    move_buffers(m, torch.device("meta"))
    assert all(b.is_meta for b in m.buffers())
    assert not any(p.is_meta for p in m.parameters())
    assert "scratch" not in m.state_dict() and "running_mean" in m.state_dict()


def test_dynamo_counters_and_compile_timers():
    """trainer/engine/compile.py's CompileStats reads dynamo's `counters` (graph breaks, unique graphs), its
    per-compile records (`get_compilation_metrics`: recompiles and their reasons) and
    `compilation_time_metrics` (the forward frames' and the lazy backward's compile timers), and raises `torch._dynamo.config.recompile_limit`. torch has no public API for either figure
    (`torch._dynamo.explain` recompiles the function to find out). End to end: the compile lines the
    torchrun test in test_diffusion_fsdp.py asserts on."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    from trainer.engine.compile import _COMPILE_TIMERS, CompileStats

    _guard(hasattr(torch._dynamo.config, "recompile_limit"), "torch._dynamo.config.recompile_limit is gone")

    def f(x):
        y = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return torch.cos(y).sum()

    # dynamo keeps its last 64 compiles' records, from which recompiles are counted: start this count empty
    torch._dynamo.utils.clear_compilation_metrics()
    before = CompileStats.now()
    x = torch.randn(8, requires_grad=True)
    # a real compile, not a hit in inductor's or AOT autograd's on-disk caches (warm from an earlier run),
    # which loads the backward without the timer
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(f, dynamic=False)
        compiled(x).backward()
        after = CompileStats.now()
        compiled(torch.randn(4, requires_grad=True)).backward()  # static shapes: another size recompiles
    again = CompileStats.now()
    _guard(after.recompiles == before.recompiles, f"a first compile counted as a recompile: {after}")
    _guard(
        again.recompiles == after.recompiles + 2,  # f's two frames (before and after the break) recompile
        f"torch._dynamo.utils.get_compilation_metrics() has no recompile_reason for a recompile: {again}",
    )
    _guard(
        any("size mismatch" in r for r in again.recompile_reasons),
        f"dynamo's recompile_reason no longer names the guard that failed: {again.recompile_reasons}",
    )
    for key in ("graph_break", "stats"):
        _guard(key in counters, f"torch._dynamo.utils.counters has no {key!r} counter any more")
    _guard(after.graph_breaks == before.graph_breaks + 1, "dynamo's counters['graph_break'] did not count a break")
    _guard(after.graphs >= before.graphs + 2, "dynamo's counters['stats']['unique_graphs'] did not count graphs")
    for key in _COMPILE_TIMERS:
        _guard(
            bool(compilation_time_metrics.get(key)),
            f"torch._dynamo.utils.compilation_time_metrics has no {key!r} timer; CompileStats.seconds undercounts",
        )
    _guard(after.seconds > before.seconds, "dynamo's compile timers did not grow with a compile")


def test_torchao_8bit_state_flattens_to_codes_scale_and_map():
    """trainer/checkpoint/quantized.py saves torchao's OptimState8bit (module `torchao.optim.subclass_8bit`, not
    in `torchao.optim.__all__`) as the tensors its `__tensor_flatten__` names plus (signed, dtype), and
    rebuilds it with `__tensor_unflatten__`; trainer/optim.py relies on AdamW8bit keeping each group's lr as a
    tensor. End to end: tests/test_optim.py's round trip, tests/test_diffusion_fsdp.py's adamw8bit case."""
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros((16, 256), signed=True, block_size=256, dtype=torch.float32)
    names, attrs = state.__tensor_flatten__()
    _guard(
        names == ["codes", "scale", "qmap"] and attrs == [True, torch.float32],
        f"OptimState8bit.__tensor_flatten__ now gives {names}, {attrs}; trainer/checkpoint/quantized.py's "
        "_FIELDS and its checks (uint8 codes, float32 scale per block, 256-value float32 qmap) must follow",
    )
    _guard(
        state.codes.dtype == torch.uint8 and state.scale.shape == (16,) and state.qmap.shape == (256,),
        "OptimState8bit's parts changed dtype or shape; update trainer/checkpoint/quantized.py's checks",
    )
    again = OptimState8bit.__tensor_unflatten__({n: getattr(state, n) for n in names}, attrs, None, None)
    _guard(type(again) is OptimState8bit and again.block_size == 256, "OptimState8bit.__tensor_unflatten__")
    opt = AdamW8bit(nn.Linear(2, 2).parameters(), lr=1e-3)
    _guard(
        isinstance(opt.param_groups[0]["lr"], torch.Tensor),
        "AdamW8bit no longer keeps lr as a tensor; trainer/optim.py's build_lr_schedule note and "
        "Part.lr's float() may be dropped",
    )


def test_torchao_float8_size_thresholds():
    """trainer/engine/float8.py's float8_layers keeps in bf16 the linears torchao's `_auto_filter_for_recipe`
    (exported by torchao.float8, named private and marked experimental) says float8 would slow down, with
    the thresholds its docstring and docs/scaling.md quote. End to end: tests/test_float8.py (DiT-XL/2 and
    DiT-S/2 per recipe)."""
    pytest.importorskip("torchao")
    try:
        from torchao.float8 import _auto_filter_for_recipe
    except ImportError as e:
        _guard(False, f"torchao.float8._auto_filter_for_recipe ({e}); trainer/engine/float8.py float8_layers")
    expected = {  # (in, out): (tensorwise, rowwise)
        (1152, 1152): (True, False),
        (1152, 4608): (True, True),
        (4608, 1152): (True, False),
        (384, 1536): (True, False),
        (384, 384): (False, False),
        (4096, 1024): (False, False),
        (4112, 1024): (True, False),
        (2048, 4096): (True, False),
        (1040, 4112): (True, True),
        (1152, 1160): (False, False),  # not a multiple of 16
    }
    for recipe, column in (("tensorwise", 0), ("rowwise", 1)):
        keep = _auto_filter_for_recipe(recipe, filter_fqns=[])
        got = {shape: keep(nn.Linear(*shape, device="meta"), "blocks.0.ff") for shape in expected}
        _guard(
            got == {shape: both[column] for shape, both in expected.items()},
            f"torchao's {recipe} size thresholds changed ({got}); update trainer/engine/float8.py's docstring, "
            "docs/scaling.md#float8 and the layer counts in tests/test_float8.py",
        )


def test_fake_tensor_mode_for_the_flop_count():
    """trainer/engine/step.py counts a step's FLOPs under torch._subclasses.fake_tensor.FakeTensorMode (with
    allow_non_fake_inputs: the real parameters join as fakes), so nothing is computed or allocated. End to
    end: tests/test_gpu_step.py (the same count as a real step, nothing changed, no activation memory)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    except ImportError as e:
        _guard(False, f"torch._subclasses.fake_tensor.FakeTensorMode ({e}); trainer/engine/step.py count_flops")
    weight = torch.randn(8, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.randn(3, 4) @ weight.T
    _guard(
        isinstance(out, FakeTensor) and tuple(out.shape) == (3, 8),
        "FakeTensorMode(allow_non_fake_inputs=True) no longer mixes real inputs into fake ops; "
        "trainer/engine/step.py count_flops must fake the parameters itself (FakeTensorMode.from_tensor)",
    )


# Where each diffusers class gentrain builds is imported from (its own module, not diffusers' top level).
def _diffusers_imports() -> dict[tuple[str, str], str]:
    """{(module, name): where} for every `from diffusers.<module> import <name>` in trainer/ (module level or
    inside a function): the paths gentrain relies on, read from the source so none is missed."""
    import ast

    found: dict[tuple[str, str], str] = {}
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffusers."):
                for alias in node.names:
                    found.setdefault((node.module, alias.name), f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_diffusers_classes_in_their_own_modules_and_the_packages_imported_lazily():
    """trainer/ imports each diffusers class from its own module (diffusers documents the classes, not these
    paths; every such import is read from the source), and trainer/lazy_packages.py
    defers the `__init__` of the packages that import every module in them. If diffusers moves a class or
    stops being a package there, this names what to update. End to end: tests/test_startup.py (what a
    digits-ddpm run imports)."""
    import importlib
    import importlib.util

    import diffusers

    from trainer.lazy_packages import LAZY_PACKAGES

    imports = _diffusers_imports()
    assert ("diffusers.models.unets.unet_2d", "UNet2DModel") in imports  # the scan finds them
    for (module, name), where in imports.items():
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            _guard(False, f"{module}.{name} ({e}): update the gentrain import of {name} at {where}")
        _guard(getattr(diffusers, name, cls) is cls, f"{module}.{name} is not diffusers.{name}: update {where}")
    for package in sorted(LAZY_PACKAGES):
        spec = importlib.util.find_spec(package)
        _guard(
            spec is not None and spec.submodule_search_locations is not None,
            f"{package} is no longer a package: drop it from trainer/lazy_packages.py LAZY_PACKAGES",
        )
    # ON_FIRST_USE: each name still comes from one module of its package, and diffusers' modules only call
    # it (attribute access: from_config, merge_quantization_configs), which the stand-in passes on.
    from trainer.lazy_packages import ON_FIRST_USE, _sources

    for package, names in ON_FIRST_USE.items():
        sources = _sources(importlib.util.find_spec(package).origin)
        for name in names:
            _guard(name in sources, f"{package} no longer imports {name} from one module: update ON_FIRST_USE")
            real = getattr(importlib.import_module(f"{package}.{sources[name][0]}"), sources[name][1])
            _guard(isinstance(real, type), f"{package}.{name} is no longer a class: update ON_FIRST_USE")
            for user in ("models/modeling_utils.py", "loaders/single_file_model.py"):
                source = (Path(diffusers.__file__).parent / user).read_text()
                uses = re.findall(rf"\b{name}\b(.?)", source)
                _guard(
                    all(after in (".", "", ",") for after in uses),
                    f"diffusers/{user} uses {name} other than by attribute: drop it from ON_FIRST_USE",
                )
    # PACKAGE_MAP_ON_FIRST_USE: each module still calls packages_distributions() when imported (else the hook is
    # dead weight). That every flag diffusers computes is unchanged: tests/test_startup.py.
    import ast

    from trainer.lazy_packages import PACKAGE_MAP_ON_FIRST_USE

    for module in sorted(PACKAGE_MAP_ON_FIRST_USE):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        calls = [
            node
            for statement in tree.body
            if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))  # runs on import
            for node in ast.walk(statement)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "packages_distributions"
        ]
        _guard(
            bool(calls),
            f"{module} no longer calls packages_distributions() on import: drop it from "
            "trainer/lazy_packages.py PACKAGE_MAP_ON_FIRST_USE",
        )


def test_inductor_cache_dir():
    """trainer/engine/compile_cache.py packs and restores inductor's local cache folder, which it asks
    `torch._inductor.runtime.cache_dir_utils.cache_dir` for (TORCHINDUCTOR_CACHE_DIR, else torch's default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError as e:
        _guard(False, f"torch._inductor.runtime.cache_dir_utils.cache_dir ({e}); trainer/engine/compile_cache.py")
    import os

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/gentrain-guard-inductor"
    try:
        _guard(cache_dir() == "/tmp/gentrain-guard-inductor", "cache_dir() no longer reads TORCHINDUCTOR_CACHE_DIR")
    finally:
        if old is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def test_fused_adamw_takes_found_inf_from_the_optimizer():
    """trainer/optim.py `step_unless` hands fused AdamW a step's verdict as `optimizer.found_inf`, the attribute
    torch.amp.GradScaler.step sets for optimizers with `_step_supports_amp_scaling`; 1.0 leaves everything as
    it was. End to end: tests/test_nonfinite.py."""
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    _guard(getattr(opt, "_step_supports_amp_scaling", False), "fused AdamW no longer supports amp scaling")
    _guard("found_inf" in inspect.getsource(torch.optim.Adam.step), "Adam.step no longer reads self.found_inf")
    p.grad = torch.full((4,), float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    _guard(torch.equal(p.detach(), torch.ones(4)), "fused AdamW stepped although found_inf was 1: see trainer/optim.py")
