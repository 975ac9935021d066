"""LLM-as-judge rewards (molt.agents.judge) on the tiny model: the judge runs on an engine actor of its own
started from the spec (agent.judge), and a reward is its probability of "yes" against "no", checked here
against a plain transformers forward of the judge's weights; one training step runs on judged rollouts.
"""

from __future__ import annotations

import math
import sys

import pytest
import ray
import torch
from agentlib import Runners, train_one_step
from ray.exceptions import RayActorError
from test_agents import Recorder, assert_exact, encode, run_all

from molt.agents.render import render
from molt.spec import RunSpec, SpecError, validate_spec

ITEM = {"prompt": "What is 2+3?", "label": "5"}


def reference_p_yes(model, tok, messages: list[dict], temperature: float) -> float:
    """p(yes) / (p(yes) + p(no)) at `temperature`, from one forward of the judge's weights per word."""
    prompt = encode(tok, render(tok, messages))
    logps = []
    for word in ("yes", "no"):
        ids = prompt + encode(tok, word)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        logps.append(sum(float(logp[t - 1, ids[t]]) for t in range(len(prompt), len(ids))))
    return 1.0 / (1.0 + math.exp(-(logps[0] - logps[1]) / temperature))


def engine_stops(engine, within_s: float = 60.0) -> bool:
    """Whether `engine`'s actor is gone within `within_s` (a kill reaches the actor after the call returns,
    so a request right after it may still be answered)."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(engine.stats.remote(), timeout=10)
        except RayActorError:
            return True
        time.sleep(1)
    return False


def test_judged_rewards_match_the_judges_weights_and_train(tok, engine, trainer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    sampler, runners = Recorder(engine, training=True), Runners(tok)
    try:
        runner = runners("judge_env.py", {"judge": {"path": tiny_model_path, "temperature": 0.5}},
                         max_tokens=16)
        judge_engines = runner.judge.sampler.engines
        assert engine not in judge_engines   # its own engine, which no refit ever reaches
        rollouts = run_all(runner, [ITEM] * 4, sampler, group="judge")
    finally:
        runners.close()
    assert runner.judge is None
    assert engine_stops(judge_engines[0])   # close() stopped the judge's engine
    grader = sys.modules[runner.env_cls.__module__].GRADER
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for r in rollouts:
        [[call]] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        answer = tok.decode(call["out"]["token_ids"], skip_special_tokens=True)
        verdict = [{"role": "system", "content": grader},
                   {"role": "user", "content": f"Question: {ITEM['prompt']}\nReference answer: 5\n"
                                               f"Answer: {answer}\nIs the answer correct?"}]
        assert 0.0 < r.reward < 1.0
        assert r.reward == pytest.approx(reference_p_yes(model, tok, verdict, 0.5), abs=1e-3)
    # The judge's requests never went through the policy's sampler.
    assert all("prompt_logprobs" not in c["sampling"] for c in sampler.calls)
    train_one_step(trainer, rollouts, sampler, tok)


def test_judge_engines_get_gpus_of_their_own_in_the_plan():
    from molt.driver.compose import compose
    from molt.plan.memory import estimates
    from molt.plan.placement import describe, plan

    gpu = ["agent=judge", "parallel=gpu8", "parallel.nodes=1", "parallel.trainer_nodes=null",
           "parallel.dp_size=4", "model.dtype=bfloat16",
           "rollout.engine.num_engines=2", "agent.judge.engine.num_engines=1", "agent.judge.engine.tp_size=2"]
    spec = compose(gpu)
    slots = plan(spec)
    assert [(s.role, s.index, s.gpus) for s in slots if s.role == "judge"] == [("judge", 0, 2)]
    assert sum(s.gpus for s in slots) == 4 + 2 + 2
    assert describe(spec)[0] == "node 0: policy ranks 0-3, engines 0-1, judge engine 0 | 8/8 GPUs"
    assert "judge engine GPU" in [e.role for e in estimates(spec)[0]]
    # one judge GPU more than the node has is refused before anything starts, naming the judge's engines
    with pytest.raises(SpecError, match=r"needs 9 GPUs \(policy 4 \+ 2 engines x 1 \+ 1 judge engines x 3\)"):
        compose([*gpu[:-1], "agent.judge.engine.tp_size=3"])
    # a judge at a URL runs elsewhere: no GPUs for it
    remote = compose([*gpu, "agent.judge.url=http://127.0.0.1:9/v1"])
    assert not [s for s in plan(remote) if s.role == "judge"]
    # on CPU the judge's engine is planned too (a node to run on), sharing cores
    assert [(s.role, s.node) for s in plan(compose(["agent=judge"]))] == [("policy", 0), ("engine", 0),
                                                                           ("judge", 0)]
    with pytest.raises(SpecError, match="agent.judge.url=.* needs agent.judge.path"):
        validate_spec({"agent": {"judge": {"url": "http://127.0.0.1:9/v1"}}})
    assert RunSpec.model_validate({"agent": {"judge": {"path": "policy"}}}).agent.judge.temperature == 1.0


def test_a_runner_set_up_without_the_judges_engines_says_what_to_call(tok, tiny_model_path):
    """The judge's engines are the driver's to start (molt.driver.judge_engines): a runner set up without a
    judge while agent.judge.path needs engines is refused, naming the call, before anything starts."""
    from test_agents import EXAMPLES, make_spec

    from molt.agents import load_agent_runner

    spec = make_spec({"module": str(EXAMPLES / "judge_env.py"), "judge": {"path": tiny_model_path}})
    runner = load_agent_runner(spec.agent)
    with pytest.raises(RuntimeError, match=r"agent.judge.path=.* runner.setup\(tokenizer, spec, "
                                           r"molt.driver.judge_engines.start_judge\(spec\)\)"):
        runner.setup(tok, spec)


VERDICT = [{"role": "system", "content": "Grade the answer."},
           {"role": "user", "content": "Question: What is 2+3?\nAnswer: 5\nIs the answer correct?"}]


@pytest.mark.slow   # vLLM's server starts in a process of its own: 1-3 minutes on 2 busy cores
def test_a_judge_at_a_url_scores_through_an_openai_compatible_server(tok, tiny_model_path):
    """vLLM's own OpenAI server on 127.0.0.1 serves the judge; the verdict equals the judge's weights'."""
    import asyncio
    import os
    import socket
    import subprocess
    import time
    import urllib.request

    from transformers import AutoModelForCausalLM

    from molt.agents.judge import Judge

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_path, "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the judge's server did not come up"
                time.sleep(2)
        spec = RunSpec.model_validate({"agent": {"judge": {"path": tiny_model_path, "url": url,
                                                           "temperature": 0.5}}})
        judge = Judge.start(spec)
        assert judge.sampler is None   # no engines of the run
        p = asyncio.run(judge.p_yes(VERDICT))
    finally:
        server.terminate()
        server.wait(timeout=60)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert 0.0 < p < 1.0
    assert p == pytest.approx(reference_p_yes(model, tok, VERDICT, 0.5), abs=1e-3)


def test_a_judge_that_never_answers_is_retried_within_its_bound_then_fails_the_rollout(tok):
    """A real HTTP server on 127.0.0.1 that reads each request and never answers (the fault a stuck judge
    server causes): every verdict request times out, is retried agent.judge.retries times, and no more than
    agent.judge.max_concurrency are open at once; the rollout fails with an AgentError."""
    import asyncio

    import openai

    from molt.agents.judge import Judge
    from molt.spec import JudgeSpec
    from molt.trajectory import AgentError

    seen = {"requests": 0, "open": 0, "most": 0}

    async def stuck(reader, writer):
        seen["requests"] += 1
        seen["open"] += 1
        seen["most"] = max(seen["most"], seen["open"])
        try:
            while await reader.read(4096):   # until the client gives up and closes
                pass
        finally:
            seen["open"] -= 1
            writer.close()

    async def main():
        server = await asyncio.start_server(stuck, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        settings = JudgeSpec(path="policy", url=url, timeout_s=0.5, retries=2, max_concurrency=2)
        client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=30)
        judge = Judge(tok, settings, client=client, model="judge")
        try:
            # one verdict: "yes" and "no" side by side, three tries each
            with pytest.raises(AgentError, match=r"no verdict in 3 tries \(TimeoutError after agent.judge."
                                                 r"timeout_s=0.5\)"):
                await judge.p_yes(VERDICT)
            assert (seen["requests"], seen["most"]) == (6, 2)
            # three verdicts at once want six requests in flight; two are
            failed = await asyncio.gather(*[judge.p_yes(VERDICT) for _ in range(3)], return_exceptions=True)
            assert all(isinstance(f, AgentError) for f in failed) and seen["most"] == 2
        finally:
            server.close()
    asyncio.run(main())
