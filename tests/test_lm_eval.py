"""engine/lm_eval_model.py: lm-evaluation-harness scoring on a jaxfill Engine agrees with
lm_eval's own `hf` model on the same checkpoint (configs/tiny in transformers).

The tasks are local (a YAML and a jsonl written to tmp_path; nothing is downloaded). Both
models score the same token sequences: the tiny checkpoint's tokenizer.json is the byte
tokenizer with a BOS post-processor, so `hf`'s default encoding (BOS + bytes) is jaxfill's
for loglikelihood and generation. Rolling loglikelihoods are compared with an `hf` run with
add_bos_token=False: by default lm_eval 0.4.13's `hf` encodes the text with the tokenizer's
BOS and then prepends its prefix token (BOS) again, scoring the text after [BOS, BOS]; with
add_bos_token=False it scores it after one BOS, as jaxfill does. `hf` gets max_length =
engine max_model_len - 2, the longest sequence the engine scores (prompt + one generated
token fits), so both truncate long contexts and cut rolling windows at the same places;
some texts here are longer than that on purpose."""

import json
import math

import pytest

pytest.importorskip("torch")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm_eval's `hf` model imports it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from jaxfill import Engine  # noqa: E402
from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.lm_eval_model import JaxfillLM  # noqa: E402

MAX_MODEL_LEN = 96
ENGINE = {"engine.max_model_len": MAX_MODEL_LEN, "engine.num_pages": 128, "engine.max_num_seqs": 8,
          "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64]}

# label: the index of the true line; the first context is over MAX_MODEL_LEN on purpose
MC = [
    {"context": "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet "
                "is the sun. Arise, fair sun, and kill the envious", "choices": [" moon", " cat", " table"],
     "label": 0},
    {"context": "HAMLET:\nTo be, or not to be, that is the", "choices": [" question", " answer", " kettle"],
     "label": 0},
    {"context": "MACBETH:\nIs this a dagger which I see before", "choices": [" me", " breakfast", " thee"],
     "label": 0},
    {"context": "JULIET:\nO Romeo, Romeo, wherefore art thou", "choices": [" Romeo?", " going?", " here?"],
     "label": 0},
    {"context": "KING RICHARD III:\nNow is the winter of our", "choices": [" discontent", " dinner", " lord"],
     "label": 0},
    {"context": "First Citizen:\nBefore we proceed any further, hear me", "choices": [" speak.", " sing.", " run."],
     "label": 0},
]
ROLLING = [
    {"text": "MENENIUS:\nWhat work's, my countrymen, in hand? where go you with bats and clubs? "
             "The matter? speak, I pray you.\nFirst Citizen:\nOur business is not unknown to the senate; "
             "they have had inkling this fortnight what we intend to do, which now we'll show 'em in deeds."},
    {"text": "Good night, good night! parting is such sweet sorrow."},
]
GENERATE = [{"prompt": "ROMEO:\n"}, {"prompt": "KING HENRY V:\nOnce more unto the breach, "}]


def write_tasks(root):
    def dataset(name, rows):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
                f"  cache_dir: {root / 'hf_datasets'}\ntest_split: test\n")

    (root / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + dataset("mc", MC) + "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / "tiny_rolling.yaml").write_text(
        "task: tiny_rolling\n" + dataset("rolling", ROLLING) + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (root / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + dataset("gen", GENERATE) + "output_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: ''\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def engine():
    with Engine(load_config("tiny", ENGINE), progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def evaluated(engine, tmp_path_factory):
    """{model: simple_evaluate's results} for jaxfill and `hf`, same tasks."""
    from test_tiny_trained import TINY_DIR

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(root)
    tasks = ["tiny_mc", "tiny_rolling", "tiny_gen"]

    def run(model, model_args=None, tasks=tasks):
        # include_defaults=False: indexing lm_eval's thousands of built-in task YAMLs takes ~8 s a run
        manager = TaskManager(include_path=str(root), include_defaults=False)
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                       batch_size=32, task_manager=manager, bootstrap_iters=0)
    hf = f"pretrained={TINY_DIR},dtype=float32,device=cpu,max_length={MAX_MODEL_LEN - 2}"
    return {"jaxfill": run(JaxfillLM(engine=engine)), "hf": run("hf", hf, tasks=["tiny_mc", "tiny_gen"]),
            "hf_one_bos": run("hf", hf + ",add_bos_token=False", tasks=["tiny_rolling"])}


def responses(results, task):
    """Per document (in doc order): the model's raw responses."""
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_loglikelihoods_and_accuracy_equal_hf(evaluated):
    ours, theirs = (responses(evaluated[m], "tiny_mc") for m in ("jaxfill", "hf"))
    assert len(ours) == len(MC)
    for doc, a, b in zip(MC, ours, theirs):
        assert len(a) == len(b) == len(doc["choices"])
        for (lp_a, greedy_a), (lp_b, greedy_b) in ((x[0], y[0]) for x, y in zip(a, b)):
            assert abs(float(lp_a) - float(lp_b)) < 1e-4, (doc["context"][-20:], lp_a, lp_b)
            assert bool(greedy_a) == bool(greedy_b)
    for metric in ("acc,none", "acc_norm,none"):
        assert evaluated["jaxfill"]["results"]["tiny_mc"][metric] == evaluated["hf"]["results"]["tiny_mc"][metric]
    assert 0 < evaluated["jaxfill"]["results"]["tiny_mc"]["acc,none"] < 1  # a 0.8M model: some right, some wrong


def test_rolling_loglikelihoods_equal_hf_across_windows(evaluated):
    assert len(ROLLING[0]["text"]) > 2 * MAX_MODEL_LEN  # three windows
    ours, theirs = (responses(evaluated[m], "tiny_rolling") for m in ("jaxfill", "hf_one_bos"))
    for a, b in zip(ours, theirs):
        assert abs(float(a[0][0]) - float(b[0][0])) < 1e-4, (a, b)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        x, y = (evaluated[m]["results"]["tiny_rolling"][metric] for m in ("jaxfill", "hf_one_bos"))
        assert math.isclose(x, y, rel_tol=1e-5), (metric, x, y)


def test_generate_until_equals_hf_greedy(evaluated):
    ours, theirs = (responses(evaluated[m], "tiny_gen") for m in ("jaxfill", "hf"))
    assert ours == theirs
    assert all(r[0] and "\n" not in r[0] for r in ours)  # stopped at the newline, not included


def test_loglikelihood_direct(engine):
    """The sums are over the continuation's own tokens; an empty context is BOS; is_greedy
    holds for a continuation made of the argmax tokens."""
    lm = JaxfillLM(engine=engine)
    req = lambda *args: Instance("loglikelihood", {}, args, 0)  # noqa: E731
    ctx = "HAMLET:\nTo be, or not to be, that is the"
    greedy = lm.generate_until([Instance("generate_until", {}, (ctx, {"max_gen_toks": 3}), 0)])[0]
    (whole, g0), (first, _), (rest, _), (empty, _), (roll,) = (
        *lm.loglikelihood([req(ctx, greedy), req(ctx, greedy[:2]), req(ctx + greedy[:2], greedy[2:]),
                           req("", ctx)]),
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ctx,), 0)]))
    assert g0 and len(greedy.encode()) == 3
    assert abs(whole - (first + rest)) < 1e-4
    assert abs(empty - roll) < 1e-5
    assert lm.loglikelihood([req(ctx, " kettle")])[0][1] is False
