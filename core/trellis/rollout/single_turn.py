"""The ``single_turn`` agent loop: one prompt, one generated response."""

from __future__ import annotations

from typing import Any

from trellis.rollout.agent_loop import AgentLoop, AgentLoopOutput
from trellis.rollout.sampling import SamplingParams


class SingleTurnAgentLoop(AgentLoop):
    """Generate once from the sample's prompt (``raw_prompt_ids``, else ``raw_prompt`` through the chat
    template); every response token is the model's (``response_mask`` all 1)."""

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        prompt_ids = self.prompt_ids(sample)
        out = await self.server.generate(prompt_ids, sampling_params, sample.get("multi_modal_data"))
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=list(out.token_ids),
            response_mask=[1] * len(out.token_ids),
            response_logprobs=list(out.log_probs) if out.log_probs is not None else None,
            num_turns=2,
            metrics={"agent/truncated": float(out.stop_reason == "length")},
            response_versions=list(out.weight_versions) if out.weight_versions is not None else None,
        )
