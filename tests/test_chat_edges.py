"""Probes: chat's context trimming at the exact edge, /set keys in any case, /set seed default."""
import pytest

from clover_lite.cli.chat import ChatSession
from clover_lite.runtime.generation import GenerationConfig


def _filled_to(session, engine, free: int) -> str:
    """A user message that leaves exactly `free` positions of the context after the prompt."""
    limit = engine.context_limit
    for n in range(limit - len(session.prompt_ids("")) - free - 8, limit):
        if len(session.prompt_ids("x" * n)) == limit - free:
            return "x" * n
    pytest.skip("no message length gives that prompt length")


def test_the_context_edge(tiny_engine):
    session = ChatSession(tiny_engine, GenerationConfig(max_new_tokens=64))
    ids, cfg = session.request(_filled_to(session, tiny_engine, 1))
    assert len(ids) == tiny_engine.context_limit - 1 and cfg.max_new_tokens == 1
    with pytest.raises(Exception, match="fills the context .* /reset"):
        session.request(_filled_to(session, tiny_engine, 0))


def test_set_keys_any_case_and_seed_default(tiny_engine):
    session = ChatSession(tiny_engine)
    assert session.command("/set Temp 0.7").text == "temperature = 0.7"
    assert session.command("/set TOP_P 0.5").text == "top_p = 0.5"
    assert session.command("/set seed 5").text == "seed = 5"
    assert session.command("/set seed default").text == "seed = None" and session.config.seed is None
