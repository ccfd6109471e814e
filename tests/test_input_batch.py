"""SamplingRows: each request's sampling settings written once, to a row kept across steps;
a step gathers its rows; a finished request's row goes to a new one; the batch it gives is
the one SamplingBatch.build gives from the same settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_chat.engine import SamplingParams
from paged_chat.engine.core.request import Request, RequestStatus
from paged_chat.engine.worker import input_batch
from paged_chat.engine.worker.input_batch import SamplingRows
from paged_chat.engine.worker.sampler import SamplingBatch, sample

CPU = torch.device("cpu")
VOCAB = 200
SETTINGS = [SamplingParams(temperature=0.2, top_p=0.9), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=5, min_p=0.1),
            SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5)]


def request(number: int, params: SamplingParams) -> Request:
    return Request(f"req-{number}", [1, 2, 3], params, 1000 + number, 0.0)


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    """How many requests' settings SamplingRows writes."""
    written: list[int] = []
    columns = input_batch.sampling_columns

    def counted(params, vocab_size):
        written.append(len(params))
        return columns(params, vocab_size)

    monkeypatch.setattr(input_batch, "sampling_columns", counted)
    return written


def test_a_request_s_settings_are_written_once_and_its_row_kept(writes):
    table = SamplingRows(VOCAB, CPU, capacity=2)
    requests = [request(n, p) for n, p in enumerate(SETTINGS)]
    first = table.rows(requests)
    assert sorted(first.tolist()) == [0, 1, 2, 3]  # grew past its capacity
    for _ in range(5):
        assert table.rows(requests[::-1]).tolist() == first[::-1].tolist()
    assert sum(writes) == len(SETTINGS)


def test_a_finished_request_s_row_goes_to_a_new_request(writes):
    table = SamplingRows(VOCAB, CPU, capacity=2)
    done, running = request(0, SETTINGS[0]), request(1, SETTINGS[1])
    rows = table.rows([done, running]).tolist()
    done.status = RequestStatus.FINISHED
    newcomer = request(2, SETTINGS[2])
    assert table.rows([newcomer, running]).tolist() == [rows[0], rows[1]]
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    batch = table.batch(np.array([rows[0]]), torch.tensor([rows[0]]), torch.tensor([4]),
                        host_reads=True)
    alone = SamplingBatch.build([SETTINGS[2]], [newcomer.sampling_seed], [4], None, None,
                                VOCAB, CPU)
    assert torch.equal(sample(logits[:1].clone(), batch), sample(logits[:1].clone(), alone))


@pytest.mark.parametrize("host_reads", [True, False])
def test_a_step_s_batch_samples_as_the_built_one(host_reads):
    table = SamplingRows(VOCAB, CPU)
    requests = [request(n, p) for n, p in enumerate(SETTINGS)]
    table.rows(requests)
    order = [2, 0, 3]  # a step samples some of them, in its own order
    outputs = np.array([5, 0, 2])
    torch.manual_seed(2)
    for trial in range(10):
        logits = torch.randn(len(order), VOCAB) * (1 + trial)
        rows = table.rows([requests[i] for i in order])
        batch = table.batch(rows, torch.from_numpy(rows), torch.from_numpy(outputs), host_reads)
        built = SamplingBatch.build([SETTINGS[i] for i in order],
                                    [requests[i].sampling_seed for i in order], outputs.tolist(),
                                    [[1, 2, 3]] * 3, [3] * 3, VOCAB, CPU, host_reads)
        histories = [[1, 2, 3]] * 3
        batch.count_tokens(histories, [3] * 3, VOCAB, CPU)
        assert torch.equal(sample(logits.clone(), batch), sample(logits.clone(), built))
