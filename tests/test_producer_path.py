"""The producer path is top-down: split_media -> plan -> row order (balance; packing next) -> assemble
-> views, each step called from above and never calling back up.

The layers are declared once, in ``LAYERS``. Two guards: the modules' imports only point down the
table, and a traced ``split_media`` (``sys.setprofile``) of real tiny batches enters the layers in
order, never calls from a lower layer into a higher one, and makes few module stays.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import sys

import pytest

import ppmedia
import ppmedia.testing.tiny_models as tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the producer path, top (0) to bottom: (layer, its modules). A module may import and call only
#: modules of its own layer or below. "entry" is the orchestrator: it calls each step in turn.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("public", ("ppmedia.balance",)),  # public names of balancing; nothing on the path imports it
    ("entry", ("ppmedia.producer.split",)),
    ("plan", ("ppmedia.producer.plan", "ppmedia.registry", "ppmedia.registry.registry", "ppmedia.producer.layouts",
              "ppmedia.producer.declared", "ppmedia.producer.planners_audio", "ppmedia.producer.planners_frames",
              "ppmedia.producer.planners", "ppmedia.producer.hostreads")),
    ("order", ("ppmedia.producer.balancing",)),  # the row-order strategies: balancing (packing's joins here)
    ("assemble", ("ppmedia.producer.assemble",)),
    ("views", ("ppmedia.producer.staged", "ppmedia.chunk")),
    ("leaves", ("ppmedia.planning.costs",)),  # the encoder cost model: imports no ppmedia module
)
#: user-supplied callbacks the path calls (the adapter's cost function, and the cost model it calls by
#: default): transparent to the tracer
CALLBACKS = frozenset({"ppmedia.adapters.base", "ppmedia.planning.costs"})
ENTRY = 1


def layer_of(layers=LAYERS):
    return {module: i for i, (_, modules) in enumerate(layers) for module in modules}


def trace(fn, layers=LAYERS, callbacks=CALLBACKS):
    """Run ``fn()`` under ``sys.setprofile``; per Python call into a ppmedia module, the callee's module
    and layer, the nearest ppmedia caller's layer and the step (the layer of the outermost frame below
    the entry), in order. A ppmedia module outside ``layers`` and ``callbacks`` is an error."""
    layer = layer_of(layers)
    events, unknown = [], set()

    def name_of(frame):
        return frame.f_globals.get("__name__", "")

    def profile(frame, event, arg):
        if event != "call":
            return
        module = name_of(frame)
        if not module.startswith("ppmedia") or module in callbacks:
            return
        if module not in layer:
            unknown.add(module)
            return
        chain = []  # the ppmedia frames below, innermost first
        f = frame.f_back
        while f is not None:
            name = name_of(f)
            if name in layer:
                chain.append(layer[name])
            f = f.f_back
        caller = chain[0] if chain else None
        outer = [lay for lay in reversed(chain) if lay > ENTRY]  # outermost first, below the entry
        step = None if layer[module] <= ENTRY else (outer[0] if outer else layer[module])
        events.append((module, layer[module], caller, step))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert not unknown, f"the path entered ppmedia modules LAYERS does not declare: {sorted(unknown)}"
    return events


def measure(events):
    """``stays`` (runs of one module), ``modules``, ``climbs`` (calls from a lower layer into a higher
    one), ``returns`` (a stay followed by one of a higher layer, as a subroutine's return reads),
    whether the steps come in order, the steps in order (``steps``) and the runs of one step or the
    entry (``step_stays``: the entry, then each step it calls, back to the entry between them)."""
    stays = [m for i, (m, *_) in enumerate(events) if i == 0 or events[i - 1][0] != m]
    layer = {m: lay for m, lay, *_ in events}
    steps = [s for *_, s in events if s is not None]
    by_step = [ENTRY if s is None else s for *_, s in events]
    return {
        "stays": len(stays),
        "modules": len(set(stays)),
        "climbs": sum(1 for _, lay, caller, _ in events if caller is not None and lay < caller),
        "returns": sum(1 for a, b in zip(stays, stays[1:]) if layer[b] < layer[a]),
        "steps_in_order": steps == sorted(steps),
        "steps": [LAYERS[s][0] for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s],
        "step_stays": sum(1 for i, s in enumerate(by_step) if i == 0 or by_step[i - 1] != s),
        "path": stays,
    }


def _family_batch(family):
    module = tiny.load(family)
    config = module.build_config()
    adapter = ppmedia.get_adapter(config)
    batch = module.build_batch(0)
    return batch, adapter.media_counts(batch, config), functools.partial(adapter.image_costs, config=config)


CASES = ["qwen2_5_vl", "gemma3", "step3", "qwen2_5_omni"]
#: per family, the plain split's module stays and modules (a balanced one adds 3 stays and 1 module);
#: the plan step's planner <-> host-reader calls are most of them. Before the top-down path the
#: balanced splits took 44, 28, 44 and 63 stays with 6 calls back up each (docs/architecture.md).
STAYS = {"qwen2_5_vl": 34, "gemma3": 23, "step3": 33, "qwen2_5_omni": 47}
MODULES = {"qwen2_5_vl": 9, "gemma3": 9, "step3": 9, "qwen2_5_omni": 10}


@pytest.mark.parametrize("family", CASES)
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "plain"])
def test_split_media_walks_the_layers_top_down(family, balanced):
    batch, counts, cost = _family_batch(family)
    kwargs = dict(counts, balance=cost if balanced else False)
    ppmedia.split_media(dict(batch), 4, **kwargs)  # warm: imports, the registry, cached bounds
    staged = None

    def run():
        nonlocal staged
        staged = ppmedia.split_media(batch, 4, **kwargs)

    got = measure(trace(run))
    assert staged is not None and staged.n_microbatches == 4
    assert got["climbs"] == 0, got["path"]
    assert got["steps_in_order"], got["path"]
    assert got["path"][0] == "ppmedia.producer.split"
    assert got["steps"] == (["plan", "order", "assemble"] if balanced else ["plan", "assemble"]), got
    assert got["step_stays"] == (7 if balanced else 4), got  # entry, plan, entry, plan, order, assemble, entry
    assert got["modules"] <= MODULES[family] + balanced and got["stays"] <= STAYS[family] + 3 * balanced, got


def _as_module(module, source, **names):
    """The function ``source`` defines, running as if it were ``module``'s (its globals' ``__name__``)."""
    namespace = {"__name__": module, **names}
    exec(source, namespace)
    return next(v for k, v in namespace.items() if callable(v) and k not in names)


def test_the_tracer_catches_a_call_back_up_and_a_step_out_of_order():
    # planted: an order strategy that calls back into the plan step (as balance -> splitter did), and an
    # entry that plans again after assembling
    from ppmedia.producer import plan as splitter
    from ppmedia.producer.split import split_in_order

    batch, counts, _ = _family_batch("qwen2_5_vl")
    upward = _as_module("ppmedia.producer.balancing", "def order(per_sample, n):\n    splitter.default_layouts()\n"
                        "    return list(range(per_sample.batch_size))\n", splitter=splitter)
    got = measure(trace(lambda: split_in_order(dict(batch), 4, upward, **counts)))
    assert got["climbs"] == 1 and got["steps"] == ["plan", "order", "assemble"], got
    again = _as_module("ppmedia.producer.split", "def split(batch):\n    staged = split_in_order(dict(batch), 4, None, **counts)\n"
                       "    plan_split(dict(batch), 4, **counts)\n    return staged\n", split_in_order=split_in_order,
                       plan_split=splitter.plan_split, counts=counts)
    got = measure(trace(lambda: again(batch)))
    assert got["climbs"] == 0 and not got["steps_in_order"] and got["steps"] == ["plan", "assemble", "plan"], got


def _imports(path):
    """The ppmedia modules ``path`` imports (module level and inside functions)."""
    package = "ppmedia" + "".join("." + p for p in path.relative_to(ROOT / "core").with_suffix("").parts[:-1]) \
        if path.is_relative_to(ROOT / "core") else "ppmedia." + path.relative_to(ROOT).parts[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("ppmedia")}


def test_lower_layers_never_import_upper_ones():
    layer = layer_of()
    checked = 0
    for module, own in layer.items():
        spec = importlib.util.find_spec(module)
        path = pathlib.Path(spec.origin)
        for target in _imports(path):
            if target in layer:
                assert layer[target] >= own, f"{module} (layer {LAYERS[own][0]}) imports {target} (layer {LAYERS[layer[target]][0]})"
                checked += 1
    assert checked >= 20, checked


def test_every_producer_module_is_declared():
    # a new module of the producer side needs its layer (packing's row order goes in "order")
    layer = layer_of()
    path_modules = {"producer.split", "producer.plan", "balance", "producer.balancing", "producer.assemble",
                    "producer.staged", "chunk", "producer.layouts", "producer.planners", "producer.declared",
                    "producer.planners_audio", "producer.planners_frames", "producer.hostreads", "planning.costs"}
    for name in path_modules:
        assert f"ppmedia.{name}" in layer and (ROOT / "core" / f"{name.replace('.', '/')}.py").is_file(), name
    producer = {f"producer.{p.stem}" for p in (ROOT / "core" / "producer").glob("*.py") if p.stem != "__init__"}
    off_path = {"producer.staging", "producer.presplit", "producer.collate"}  # after the split: staging, feeding
    assert producer - off_path <= path_modules, sorted(producer - off_path - path_modules)
    for module in layer:
        importlib.import_module(module)
