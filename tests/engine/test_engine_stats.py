"""EngineStats, the typed value Engine.stats() returns (engine/interface.py): frozen, its
mappings read-only copies, every field defaulted; the real client produces one before
its worker starts, and /metrics reads a missing histogram as empty."""
from __future__ import annotations

import dataclasses
import types

import pytest

from mashbox.api import health, metrics
from mashbox.config import EngineConfig, ServerConfig
from mashbox.engine.client import EngineClient
from mashbox.engine.interface import EngineStats, HistogramSnapshot


def test_stats_are_frozen_and_their_mappings_read_only():
    finished = {"stop": 1}
    s = EngineStats(requests_finished=finished, histograms={"queue_time_seconds": HistogramSnapshot(count=2)})
    finished["stop"] = 5  # the value holds its own copy
    assert s.requests_finished == {"stop": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.running = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.requests_finished["stop"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        s.histograms["x"] = HistogramSnapshot()  # type: ignore[index]


def test_the_client_reports_typed_stats_that_health_and_metrics_read():
    ec = EngineConfig(model_path="/nowhere/m.gguf", model_id="m", ctx=512, slots=3)
    client = EngineClient(ec, ServerConfig())
    stats = client.stats()
    assert isinstance(stats, EngineStats)
    assert (stats.state, stats.slots, stats.ctx, stats.compiles_after_ready) == ("loading", 3, 512, None)
    assert set(stats.histograms) == {name for _, name, _ in metrics.HISTOGRAMS}
    api = types.SimpleNamespace(engine=client, info=None, engine_config=ec, ready=False)
    assert health.health_json(api)["live_rows"] is None
    text = metrics.render(api)
    assert 'mashbox:cache_config_info{block_size="512",num_blocks="3"} 1' in text
    assert "mashbox:queue_time_seconds_count" not in text  # the metric is named request_queue_time_seconds
    assert "mashbox:request_queue_time_seconds_count 0" in text


def test_metrics_reads_a_missing_histogram_as_empty():
    engine = types.SimpleNamespace(stats=lambda: EngineStats(slots=1, ctx=8))
    api = types.SimpleNamespace(engine=engine, info=None, engine_config=EngineConfig(model_path="m", model_id="m"),
                              ready=True)
    text = metrics.render(api)
    assert 'mashbox:time_to_first_token_seconds_bucket{le="+Inf"} 0' in text
    assert "mashbox:time_to_first_token_seconds_sum 0.0" in text
