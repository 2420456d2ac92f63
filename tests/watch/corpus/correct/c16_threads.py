"""Two training threads at once, each with its own model, optimizer and ``torch.Generator`` (so the
result does not depend on how the threads interleave). Each thread's graphs are its own frames'
locals; another thread's boundary must not judge them."""

import threading

import torch
from torch import nn

torch.set_num_threads(1)

THREADS, STEPS = 2, 3


def train(seed: int, out: dict[str, torch.Tensor], errors: list[BaseException]) -> None:
    try:
        _train(seed, out)
    except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread after join()
        errors.append(exc)


def _train(seed: int, out: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for name, p in model.named_parameters():
        out[f"thread{seed}.{name}"] = p.detach().clone()


def main() -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=train, args=(seed, result, errors), name=f"corpus-train-{seed}")
        for seed in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return dict(sorted(result.items()))


RESULT = main()
