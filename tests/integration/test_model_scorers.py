"""The built-in model scorers on small random Hugging Face models built here (their contracts
hold for any weights): each matches a plain `transformers` forward of one sequence at a time,
packing and batching change nothing, and scores land on the right tokens. The HTTP scorer
talks to a real local HTTP server, including a slow and a failing one."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
)

from pipeline_rl.config import ConfigError, RunConfig, ScorerConfig, load_config
from pipeline_rl.demo.tiny_model import make_tokenizer, qwen2_config
from pipeline_rl.preprocess.preprocessor import Counters, LostGroups, ScoringStage
from pipeline_rl.scorers import (
    DistillationScorer,
    HttpScorer,
    ProcessRewardScorer,
    RewardModelScorer,
    check_scorers,
    load_scorers,
)
from pipeline_rl.scorers.process_reward import step_ends
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import DeadLetter, GroupsLost, Rollout, RolloutGroup
from pipeline_rl.wire import Topic

# Batched/packed vs one-by-one forwards of the same fp32 model differ only in summation order
# (padding columns, row layout): relative errors of a few ulps times the reduction length
# (~100 terms here), i.e. ~1e-5 of values of order 1.
TOL = dict(atol=1e-4, rtol=1e-4)


def scorer_config(**kwargs):
    tok = make_tokenizer()
    return qwen2_config(
        len(tok),
        hidden=32,
        layers=2,
        intermediate=64,
        max_len=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **kwargs,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random tiny models sharing the byte-level tokenizer of the demo: policy, teacher, reward
    model (one label), token-classification PRM (two labels) and a causal-LM PRM."""
    root = tmp_path_factory.mktemp("scorer_models")
    tok = make_tokenizer()
    paths = {}
    for seed, (name, cls, extra) in enumerate(
        [
            ("policy", Qwen2ForCausalLM, {}),
            ("teacher", Qwen2ForCausalLM, {}),
            ("rm", Qwen2ForSequenceClassification, {"num_labels": 1}),
            ("prm_tc", Qwen2ForTokenClassification, {"num_labels": 2}),
            ("prm_lm", Qwen2ForCausalLM, {}),
        ]
    ):
        torch.manual_seed(seed)
        paths[name] = root / name
        cls(scorer_config(**extra)).eval().save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    chat = root / "rm_chat"
    torch.manual_seed(2)
    Qwen2ForSequenceClassification(scorer_config(num_labels=1)).save_pretrained(chat)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    tok.save_pretrained(chat)
    paths["rm_chat"] = chat
    return paths


def config(models, seq_length: int = 64) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(models["policy"])
    cfg.shared.temperature = 0.7
    cfg.preprocess.seq_length = seq_length
    return cfg


def text_rollout(prompt: str, completion: str, reward: float = 0.0) -> Rollout:
    tok = make_tokenizer()
    p, c = tok.encode(prompt, add_special_tokens=False), tok.encode(completion, add_special_tokens=False)
    g = torch.Generator().manual_seed(len(prompt) * 100 + len(completion))
    return Rollout(
        prompt_ids=p,
        completion_ids=c,
        logprobs=(-torch.rand(len(c), generator=g) * 3).tolist(),
        versions=[0] * len(c),
        reward=reward,
        finish_reason="stop",
    )


def sample_groups() -> list[RolloutGroup]:
    return [
        RolloutGroup(
            problem_id="p0",
            group_id="g0",
            rollouts=[
                text_rollout("Q: 12+34+56=", "12+34=46\n\n46+56=102"),
                text_rollout("Q: 12+34+56=", "12+34=47\n\n47+56=103\n\n"),
            ],
        ),
        RolloutGroup(
            problem_id="p1",
            group_id="g1",
            rollouts=[text_rollout("Q: 1+2+3=", "1+2=3\n\n3+3=6"), text_rollout("Q: 1+2+3=", "6")],
        ),
    ]


def test_step_ends_cut_after_each_separator():
    assert step_ends([5, 9, 9, 6, 9, 9, 7], [9, 9]) == [2, 5, 6]
    assert step_ends([5, 9, 9], [9, 9]) == [2]
    assert step_ends([5, 6], [9]) == [1]
    assert step_ends([], [9]) == []


def test_reward_model_matches_a_plain_forward_of_each_sequence(models):
    cfg = config(models)
    for name in ("rm", "rm_chat"):
        scorer = RewardModelScorer(cfg, path=str(models[name]), combine="add", weight=2.0, batch_size=3)
        groups = sample_groups()
        before = [r.reward for g in groups for r in g.rollouts]
        scorer.score(groups)
        model = AutoModelForSequenceClassification.from_pretrained(models[name]).eval()
        tok = scorer.tokenizer
        for g in groups:
            for r in g.rollouts:
                prompt, completion = tok.decode(r.prompt_ids), tok.decode(r.completion_ids)
                if name == "rm_chat":
                    text = f"<user>{prompt}\n<assistant>{completion}\n"
                else:
                    text = prompt + completion
                with torch.no_grad():
                    expected = model(input_ids=torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, 0]
                torch.testing.assert_close(torch.tensor(r.metadata["rm_score"]), expected, **TOL)
        after = [r.reward for g in groups for r in g.rollouts]
        scores = [r.metadata["rm_score"] for g in groups for r in g.rollouts]
        assert after == pytest.approx([b + 2.0 * s for b, s in zip(before, scores)])
        assert len(set(scores)) == len(scores), "distinct texts should get distinct scores"


def test_distillation_rewards_are_teacher_minus_behaviour_logprobs(models):
    cfg = config(models, seq_length=16)  # several packed rows, one sequence longer than a row
    scorer = DistillationScorer(cfg, path=str(models["teacher"]), coef=0.5)
    groups = sample_groups()
    groups[0].rollouts[0].token_rewards = [1.0] + [0.0] * (len(groups[0].rollouts[0].completion_ids) - 1)
    scorer.score(groups)
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"]).eval()
    for g in groups:
        for r in g.rollouts:
            x = torch.tensor([r.prompt_ids + r.completion_ids])
            with torch.no_grad():
                logp = torch.log_softmax(teacher(input_ids=x).logits[0, :-1] / 0.7, -1)
            t = logp.gather(-1, x[0, 1:, None])[:, 0][len(r.prompt_ids) - 1 :]
            expected = 0.5 * (t - torch.tensor(r.logprobs))
            if r is groups[0].rollouts[0]:
                expected[0] += 1.0  # added to the rewards already there
            torch.testing.assert_close(torch.tensor(r.token_rewards), expected, **TOL)


@pytest.mark.parametrize("kind", ["token_classification", "causal_lm"])
def test_prm_scores_each_step_on_its_last_token(models, kind):
    path = models["prm_tc" if kind == "token_classification" else "prm_lm"]
    cfg = config(models, seq_length=40)  # rows of one or two sequences
    scorer = ProcessRewardScorer(cfg, path=str(path), kind=kind, marker="#", step_reward="raw", outcome="min")
    groups = sample_groups()
    scorer.score(groups)
    tok = make_tokenizer()
    model_cls = AutoModelForTokenClassification if kind == "token_classification" else AutoModelForCausalLM
    model = model_cls.from_pretrained(path).eval()
    plus, minus = tok.encode("+", add_special_tokens=False)[0], tok.encode("-", add_special_tokens=False)[0]
    for g in groups:
        for r in g.rollouts:
            completion = tok.decode(r.completion_ids)
            steps = [s for s in completion.split("\n\n") if s]
            # The PRM's input: prompt, then each step followed by the marker.
            ids = tok.encode(tok.decode(r.prompt_ids), add_special_tokens=False)
            marks = []
            for step in steps:
                ids += tok.encode(step + "#", add_special_tokens=False)
                marks.append(len(ids) - 1)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, marks]
            if kind == "token_classification":
                expected = logits.softmax(-1)[:, 1]
            else:
                expected = logits[:, [plus, minus]].softmax(-1)[:, 0]
            scores = r.metadata["prm_step_scores"]
            torch.testing.assert_close(torch.tensor(scores), expected, **TOL)
            # Each score sits on exactly the last token of its step (separator included).
            ends = []
            text = ""
            for t, token in enumerate(r.completion_ids):
                text += tok.decode([token])
                if text.endswith("\n\n") or t == len(r.completion_ids) - 1:
                    ends.append(t)
                    text = ""
            assert [t for t, x in enumerate(r.token_rewards) if x != 0] == ends
            assert [r.token_rewards[t] for t in ends] == pytest.approx(scores)
            assert r.reward == pytest.approx(min(scores))
    # Packed into one row each or one row for everything: the same scores.
    for seq_length in (1, 4096):
        again = sample_groups()
        ProcessRewardScorer(
            config(models, seq_length), path=str(path), kind=kind, marker="#", step_reward="raw", outcome="min"
        ).score(again)
        for a, b in zip([r for g in groups for r in g.rollouts], [r for g in again for r in g.rollouts]):
            torch.testing.assert_close(
                torch.tensor(a.metadata["prm_step_scores"]), torch.tensor(b.metadata["prm_step_scores"]), **TOL
            )


def test_prm_centred_step_rewards_sum_to_zero_over_a_group(models):
    scorer = ProcessRewardScorer(config(models), path=str(models["prm_tc"]), kind="token_classification", marker="#")
    groups = sample_groups()
    scorer.score(groups)
    for g in groups:
        total = sum(sum(r.token_rewards) for r in g.rollouts)
        assert abs(total) < 1e-5 * sum(len(r.metadata["prm_step_scores"]) for r in g.rollouts)
        assert all(r.reward == 0.0 for r in g.rollouts)  # outcome: none by default


def test_config_errors_name_the_key(models):
    base = [f"model.path={models['policy']}"]
    distill = (
        f"preprocess.scorers=[{{cls: 'pipeline_rl.scorers:DistillationScorer', kwargs: {{path: {models['teacher']}}}}}]"
    )
    # The scorers check themselves when loaded (the launcher runs the same check at launch).
    with pytest.raises(ConfigError, match=r"'trainer.loss.kl_coef' > 0 needs a scorer .* produces ref_logprobs"):
        check_scorers(load_config("base", [*base, "trainer.loss.kl_coef=0.1", distill]))
    ref = "preprocess.scorers=[{cls: 'pipeline_rl.scorers:ReferenceLogprobScorer'}]"
    check_scorers(load_config("base", [*base, "trainer.loss.kl_coef=0.1", ref]))
    cfg = config(models)
    cfg.preprocess.scorers = [
        ScorerConfig(
            cls="pipeline_rl.scorers:ProcessRewardScorer",
            kwargs={"path": str(models["prm_tc"]), "kind": "x", "marker": "#"},
        )
    ]
    with pytest.raises(ValueError, match=r"preprocess\.scorers\.0\.kwargs.*'x' is not a valid PrmKind"):
        load_scorers(cfg)
    cfg.preprocess.scorers = [ScorerConfig(cls="pipeline_rl.scorers:HttpScorer", kwargs={"urll": "http://x"})]
    with pytest.raises(ValueError, match=r"preprocess\.scorers\.0\.kwargs.*urll"):
        load_scorers(cfg)


# The client's time limit per request: long enough that a quick answer never misses it on a slow,
# loaded CI machine.
HTTP_TIMEOUT_S = 2.0


class RewardServer:
    """A real HTTP reward server on a free loopback port. Reward = completion length; problem
    "slow" sleeps past the client's time limit; problem "flaky" fails with 500 twice per
    distinct request, then answers; problem "broken" always fails with 500; problem "bad"
    gets 400."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.seen: dict[bytes, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                items = orjson.loads(body)["items"]
                problems = sorted({i["problem_id"] for i in items})
                server.calls.append(problems)
                server.seen[body] = server.seen.get(body, 0) + 1
                if "slow" in problems:
                    time.sleep(2 * HTTP_TIMEOUT_S)
                status = 200
                if "broken" in problems or ("flaky" in problems and server.seen[body] <= 2):
                    status = 500
                elif "bad" in problems:
                    status = 400
                reply = {"rewards": [float(len(i["completion"])) for i in items]}
                if status == 200:
                    reply["token_rewards"] = [[0.5] * len(i["completion_ids"]) for i in items]
                data = orjson.dumps(reply if status == 200 else {"error": "no"})
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except BrokenPipeError:  # the client gave up (the slow case)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def reward_server():
    server = RewardServer()
    yield server
    server.close()


def http_group(problem: str, n: int = 2) -> RolloutGroup:
    return RolloutGroup(
        problem_id=problem,
        group_id=f"g-{problem}",
        rollouts=[text_rollout("Q: 1+1=", "2" * (k + 1), reward=1.0) for k in range(n)],
    )


def test_http_scorer_against_a_real_server(models, reward_server, tmp_path):
    cfg = config(models)
    cfg.run_dir = str(tmp_path)
    scorer = HttpScorer(
        cfg, url=reward_server.url, batch_groups=1, concurrency=3, timeout_s=HTTP_TIMEOUT_S, retries=2, backoff_s=0.05
    )
    names = ["ok", "flaky", "slow", "broken", "bad", "ok2"]
    streams = open_streams(cfg)
    writer = streams.writer(Topic.ACTOR)
    written_at = time.time() - 5.0  # written by an actor 5 s before scoring starts
    for name in names:
        group = http_group(name)
        group.written_at = written_at
        writer.write(group)
    writer.flush()
    entries = streams.reader(Topic.ACTOR, RolloutGroup).read(timeout=2, max_count=len(names))
    counters = Counters()
    stage = ScoringStage([scorer], streams, counters, LostGroups(streams, 1, counters))
    start = time.monotonic()
    scored = stage(entries)
    elapsed = time.monotonic() - start
    assert [g.problem_id for g in scored] == ["ok", "flaky", "ok2"]
    for g in scored:
        assert [r.reward for r in g.rollouts] == [1.0, 2.0]  # replaced by the server's rewards
        assert all(r.token_rewards == [0.5] * len(r.completion_ids) for r in g.rollouts)
    # The flaky request succeeded on its third try; the bad one was not retried; the slow and
    # the broken ones were tried 1 + retries times.
    tries = {name: sum(name in c for c in reward_server.calls) for name in names}
    assert tries == {"ok": 1, "flaky": 3, "slow": 3, "broken": 3, "bad": 1, "ok2": 1}
    # Three requests in flight at once: the slow one's three timed-out tries (3 time limits plus
    # backoff) bound the batch's time, not the sum of all tries.
    assert elapsed < 3 * HTTP_TIMEOUT_S + 0.05 + 0.1 + 1.5
    dead = {e.record.payload: e.record for e in streams.reader(Topic.SCORER_DEAD, DeadLetter).read(timeout=2)}
    errors = {orjson.loads(p)["problem_id"]: letter.error for p, letter in dead.items()}
    assert set(errors) == {"slow", "broken", "bad"}
    assert "timed out" in errors["slow"] and "HTTP 500" in errors["broken"] and "HTTP 400" in errors["bad"]
    lost = streams.reader(Topic.LOST, GroupsLost).read(timeout=2)
    assert sorted(i for e in lost for i in e.record.ids) == ["g-bad", "g-broken", "g-slow"]
    assert counters.totals["scorer_failed_groups"] == 3 and counters.totals["scored_groups"] == 3
    assert counters.totals["scorer_s/HttpScorer"] > 0
    # The preprocessor's lag: the groups were 5 s old (plus this test's own time) when scoring began.
    assert counters.totals["lag_groups"] == len(names)
    assert 5.0 <= counters.totals["lag_s"] / len(names) < 5.0 + elapsed + 5.0
    scorer.close()
    streams.close()
