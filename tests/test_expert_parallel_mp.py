"""Expert parallelism on 4 processes (gloo): one shared parity spawn, and docs/expert-parallel.md's
commands as written under torchrun.

The spawn (:func:`ppmedia.testing.parity.run_parity`, 4 workers, 2 steps of 2 microbatches a replica,
SGD after each): every rank's loss and every gradient it holds (expert shards gathered with
``full_tensor()``) against the model's own full-batch run, within 1e-5. A 4-rank world holds these
layouts (``ep`` carved out of ``dp``):

* ``dp2/ep2``: pp2 x dp2 x ep2 (edp 1): Qwen3-VL-MoE, GLM-4.5V, ERNIE 4.5 VL MoE;
* ``dp4/ep2``: pp1 x dp4 x ep2 (edp 2: expert gradients summed over the 2 replicas holding the same
  experts): the three families;
* ``dp2/tp2/ep2``: pp1 x dp2 x tp2 x ep2 (the 4-rank world's pp1 x dp2 x ep2 needs tp2 beside it):
  Qwen3-VL-MoE;
* ``dp2/ep2/fsdp``: pp2 x dp2 x ep2 with FSDP2 (expert shards left out of it): Qwen3-VL-MoE;
* ``dp2/ep2/pretrained``: ``stages_from_pretrained(ep_mesh=)``: each rank reads only its stage's
  tensors and only its experts' rows (elements read = elements held);
* planted bugs that must FAIL: ``ep_order`` (the experts' results combined at the unsorted (token, k)
  positions) and ``ep_averaged`` (expert gradients averaged over the ``ep`` peers instead of summed
  over ``edp``).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ppmedia.testing.parity import run_parity

QWEN = "ppmedia.testing.tiny_models.qwen3_vl_moe"
GOOD = ["1f1b/static/dp2/ep2", "gpipe/static/dp4/ep2"]
QWEN_ONLY = ["1f1b/static/dp2/tp2/ep2", "1f1b/static/dp2/ep2/fsdp", "1f1b/static/dp2/ep2/pretrained"]
PLANTED = ["1f1b/static/ep_order/dp2/ep2", "1f1b/static/ep_averaged/dp2/ep2"]
TOL = 1e-5


@pytest.fixture(scope="module")
def report():
    return run_parity([QWEN], GOOD + QWEN_ONLY + PLANTED, world_size=4, steps=2, n_microbatches=2,
                      family_scenarios={"glm4v_moe": GOOD, "ernie4_5_vl_moe": GOOD})


def _results(report):
    return {(f.family.rsplit(".", 1)[-1], s.name): s for f in report.families for s in f.scenarios}


@pytest.mark.multiprocess
def test_expert_parallel_layouts_match_the_model_and_planted_bugs_fail(report):
    results = _results(report)
    expected = {(f, n) for f in ("qwen3_vl_moe", "glm4v_moe", "ernie4_5_vl_moe") for n in GOOD}
    expected |= {("qwen3_vl_moe", n) for n in QWEN_ONLY + PLANTED}
    assert set(results) == expected, sorted(results)
    for (family, name), result in results.items():
        worst = [(s.grad_diff_lm, s.grad_diff_vision) for s in result.steps]
        if "ep_order" in name or "ep_averaged" in name:
            assert not result.passed(TOL), (family, name, worst)
            assert max(s.grad_diff_lm for s in result.steps) > 1e-4, (family, name, worst)
        else:
            assert result.passed(TOL), (family, name, result.step_problems(result.steps[0], TOL), worst)
    loaded = results[("qwen3_vl_moe", "1f1b/static/dp2/ep2/pretrained")].loaded
    assert all(r["elements_read"] == r["elements_held"] for r in loaded), loaded
    # the two ep peers of a stage hold (and read) the same count: half the experts each
    assert loaded[0]["elements_read"] == loaded[2]["elements_read"], loaded


# -- docs/expert-parallel.md's commands under torchrun ---------------------------------------------

B, MAX_LENGTH, STEPS = 4, 64, 2


def documented_ep_lines() -> list[str]:
    """docs/expert-parallel.md's three lines (tests/test_docs.py leaves them to the test below)."""
    from test_docs import DOCS, command_lines, read_blocks, section

    page = DOCS / "expert-parallel.md"
    (block,) = [b for b in read_blocks(page, section(page.read_text(), "From the command line")) if b.lang == "sh"]
    return command_lines(block)


def _model_adamw(checkpoint: pathlib.Path) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The checkpoint's model itself, one process: the loss of each of the first STEPS global batches of
    the data (unshuffled), the global norm before clipping to 1, train.py's AdamW (lr 1e-3, weight decay
    0.01 but none on 1-D tensors and the embedding table); the weights after the last step."""
    import transformers
    from train_helpers import model_loss, train_py_groups

    from ppmedia import data

    torch.set_num_threads(1)
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint).train()
    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=MAX_LENGTH,
                                     config=model.config)
    loader = data.ReplicaLoader(data.open_dataset(str(checkpoint.parent / "moe-data" / "train.jsonl")), processor,
                                global_batch_size=B, dp_rank=0, dp_size=1, seed=0, shuffle=False)
    optimizer = torch.optim.AdamW(train_py_groups(model), lr=1e-3)
    out = []
    for batch in loader:
        if len(out) == STEPS:
            break
        loss = model_loss(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((float(loss), float(norm)))
    return out, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_train_with_ep_gives_the_models_losses_resumes_without_ep_and_exports(tmp_path):
    """``--pp 2 --dp 2 --ep 2`` on a Qwen3-VL-MoE checkpoint and data: each step's loss and global norm
    within 1e-5 of the model's own AdamW run; the step-1 checkpoint resumed WITHOUT ``--ep`` gives step
    1's loss and norm again; ``--export`` reloads with ``from_pretrained`` equal to the model after the
    same two steps."""
    import transformers
    from test_docs import command_key, run_documented

    make, ep, plain = documented_ep_lines()
    assert "--pp 2 --dp 2 --ep 2" in command_key(ep) and "--ep" not in command_key(plain), (ep, plain)
    out = run_documented("docs/expert-parallel.md: From the command line", [make, ep, plain], tmp_path)[2].stdout
    assert "continuing at step 1" in out and "ep=2" in out, out
    rows = [json.loads(line) for line in (tmp_path / "ep.jsonl").read_text().splitlines()]
    reference, weights = _model_adamw(tmp_path / "moe-ckpt")
    assert [r["step"] for r in rows] == [0, 1]
    for row, (loss, norm) in zip(rows, reference):
        assert abs(row["loss"] - loss) <= TOL, (row, loss)
        assert abs(row["grad_norm"] - norm) <= TOL * max(norm, 1.0), (row, norm)
    (resumed,) = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert resumed["step"] == 1 and abs(resumed["loss"] - rows[1]["loss"]) <= TOL, (resumed, rows[1])
    assert abs(resumed["grad_norm"] - rows[1]["grad_norm"]) <= TOL * rows[1]["grad_norm"]
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "ep-export").state_dict()
    assert set(exported) == set(weights)
    worst = max(float((exported[k] - weights[k]).abs().max()) for k in weights)
    assert worst <= TOL, worst
