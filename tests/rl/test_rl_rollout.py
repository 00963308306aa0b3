"""generate_rollout's over-sampling follows filters.should_continue_sampling: it stops when the
batch is full or the sampling cap is reached, and samples one round without dynamic sampling."""

from types import SimpleNamespace

from lockstep.rl.data import Prompt, PromptSource
from lockstep.rl.rollout import RolloutSpec, generate_rollout
from lockstep.sample import Sample


class FakeEngine:
    """Answers "right" to every sample of a prompt labelled "easy" (a zero-std group) and
    alternates right / wrong for "mixed" prompts (a group that carries signal)."""

    tokenizer = SimpleNamespace(encode=lambda text: [1, 2], chat_template=None)

    def __init__(self):
        self.calls = 0

    def generate(self, requests):
        self.calls += 1
        out = []
        for r in requests:
            for i in range(r.sampling.n):
                text = "right" if r.metadata["label"] == "easy" or i % 2 else "wrong"
                out.append(Sample(prompt_ids=r.prompt_ids, response_ids=[3], rollout_logprobs=[-0.5],
                                  group_id=r.group_id, metadata={**r.metadata, "text": text}))
        return out


def reward(text, label):
    return float(text == "right")


def rollout(labels, *, batch_size, dynamic_sampling, max_rounds):
    prompts = [Prompt(prompt=f"p{i}", label=lab, index=i) for i, lab in enumerate(labels)]
    engine = FakeEngine()
    spec = RolloutSpec(n_samples=2, temperature=1.0, top_p=1.0, max_response_len=4, apply_chat_template=False, seed=0)
    samples, metrics = generate_rollout(engine, PromptSource(prompts, shuffle=False), reward, batch_size=batch_size,
                                        spec=spec, rollout_id=0, dynamic_sampling=dynamic_sampling,
                                        max_rounds=max_rounds)
    return samples, metrics, engine.calls


def test_dynamic_sampling_refills_until_the_batch_is_full():
    # rounds draw [easy, mixed], [easy, mixed], ...: one kept group per round, two needed
    samples, metrics, calls = rollout(["easy", "mixed"], batch_size=2, dynamic_sampling=True, max_rounds=8)
    assert calls == 2 and len(samples) == 4
    assert metrics["rollout/zero_std_ratio"] == 0.5


def test_dynamic_sampling_stops_at_the_cap():
    samples, _, calls = rollout(["easy"], batch_size=2, dynamic_sampling=True, max_rounds=3)
    assert calls == 3 and samples == []


def test_without_dynamic_sampling_one_round_keeps_everything():
    samples, _, calls = rollout(["easy", "mixed"], batch_size=2, dynamic_sampling=False, max_rounds=8)
    assert calls == 1 and len(samples) == 4
