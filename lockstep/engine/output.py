"""When a sequence stops, and the `Sample` records a finished request becomes.

Stop conditions, checked after every sampled token, first match wins:
    eos token (config.eos_token_ids, else the tokenizer's), unless sampling.ignore_eos  -> "stop"
    one of sampling.stop_token_ids                                                    -> "stop"
    a stop string appears in the decoded response (needs a tokenizer); the text is cut
    just before it, the tokens are kept (the trainer trains on what was sampled)       -> "stop"
    max_new_tokens generated, or the sequence fills max_model_len                      -> "length"
An aborted request's sequences finish with "abort" and whatever they had sampled.
"""

from __future__ import annotations

from lockstep.engine.request import RequestState, Sequence
from lockstep.sample import Sample


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer, max_model_len: int):
        self.eos = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check(self, seq: Sequence) -> str | None:
        """The finish reason seq reached with its last token, or None to go on."""
        p, tok = seq.sampling, seq.tokens[-1]
        if not p.ignore_eos and tok in self.eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None and self._cut_at_stop_string(seq):
            return "stop"
        if seq.num_output >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def first_stop(self, seq: Sequence, new_tokens: list[int]) -> tuple[int, str] | None:
        """Where `check` would first stop seq if new_tokens were appended one at a time:
        (index into new_tokens, reason), or None. Without stop strings (they need the decoded
        text of every prefix: append and `check` token by token for those)."""
        p = seq.sampling
        # the token after which a length cap is reached (a running sequence is below both caps)
        last = max(0, min(p.max_new_tokens - seq.num_output, self.max_model_len - len(seq.tokens)) - 1)
        stops = set(p.stop_token_ids) if p.ignore_eos else self.eos.union(p.stop_token_ids)
        for j, tok in enumerate(new_tokens[:last + 1]):
            if tok in stops:
                return j, "stop"
        return (last, "length") if last < len(new_tokens) else None

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        text = self.decode(seq.output_ids)
        hits = [i for i in (text.find(s) for s in seq.sampling.stop) if i >= 0]
        if not hits:
            return False
        seq.text = text[:min(hits)]
        return True

    def final_text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        return seq.text if seq.text is not None else self.decode(seq.output_ids)


def build_samples(state: RequestState, stop: StopChecker, routing_shape: tuple[int, int] | None) -> list[Sample]:
    """The n samples of a finished request, in sample order."""
    req = state.request
    out = []
    for seq in state.sequences:
        meta = dict(req.metadata)
        meta["request_id"] = req.request_id
        text = stop.final_text(seq)
        if text is not None:
            meta["text"] = text
        routed = None
        if req.sampling.return_routed_experts and routing_shape is not None:
            routed = seq.routed_experts(*routing_shape)
        out.append(Sample(prompt_ids=list(req.prompt_ids), response_ids=seq.output_ids,
                          rollout_logprobs=seq.logprobs, finish_reason=seq.finish_reason or "abort",
                          weight_version=seq.weight_version, routed_experts=routed,
                          top_logprobs=seq.top_logprobs if req.sampling.top_logprobs else None,
                          group_id=req.group_id, metadata=meta))
    return out
