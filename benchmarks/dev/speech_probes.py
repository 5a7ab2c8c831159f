"""Why do CTC transformers sit on the all-blank plateau? One probe per suspect.

    uv run python benchmarks/dev/speech_probes.py                         # every probe, 2 at a time
    uv run python benchmarks/dev/speech_probes.py --probes baseline warmup --updates 400

CTC models first learn to emit only blanks (loss ~3.5 per phoneme, PER 100 %) and leave that
plateau when the frames start to carry phoneme identity. The Table-3 run of the old recipe
(RAdam 1e-3, batches of 4, 1 h corpus) left the transformers there for most of their budget
while the Bi-LSTM left it after ~300 updates. Each probe below changes *one* thing from that
recipe (the ``baseline``) and trains the Table-3-scale linear transformer (4 layers x 3 heads x
32 dims) for the same number of updates on the same data, on one CPU thread:

* ``lr_paper`` / ``lr_3e-3``: learning rate (the paper's 1e-4; three times ours);
* ``warmup``: Adam with a linear warm-up over the first ``--warmup`` updates;
* ``batch16``: 16 utterances per batch instead of 4 (same number of updates);
* ``no_clip``: no gradient clipping;
* ``no_positions`` / ``learned_positions``: positional information;
* ``post_norm``: LayerNorm after the residual sum (the original transformer) instead of before;
* ``conv_frontend``: a stride-2 convolution over 3 frames as the input projection (local
  context before the first attention; the library's ``subsample=2``);
* ``softmax`` / ``bilstm``: the other encoders under the baseline recipe.

Recorded per probe: training loss every 25 updates, the first update whose running loss is below
``--plateau-exit`` (the plateau's loss is ~3.5), validation PER (greedy) every ``--eval-every``
updates, and CPU seconds. Results: ``benchmarks/dev/results/speech_probes.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import machine_info, write_csv  # noqa: E402

PROBES = {
    "baseline": "RAdam 1e-3, batch 4, clip 1.0, pre-norm, sinusoidal positions, linear projection",
    "lr_paper": "learning rate 1e-4 (the paper's)",
    "lr_3e-3": "learning rate 3e-3",
    "warmup": "Adam 1e-3 with linear warm-up",
    "batch16": "16 utterances per batch",
    "no_clip": "no gradient clipping",
    "no_positions": "no positional encoding",
    "learned_positions": "learned positions",
    "post_norm": "post-norm layers",
    "conv_frontend": "stride-2 convolution front-end (subsample=2)",
    "softmax": "softmax attention (baseline recipe)",
    "bilstm": "Bi-LSTM 3 x 96 (baseline recipe)",
    "small_sinusoidal": "sinusoidal positions scaled by 1/sqrt(d_model)",
    "recipe": "learned positions + Adam warm-up",
    "recipe_conv": "learned positions + Adam warm-up + conv front-end",
    "recipe_softmax": "softmax, learned positions + Adam warm-up",
    "final": "the CPU recipe: sinusoidal positions / sqrt(d_model) + Adam warm-up + conv front-end",
}
RECIPE = ("recipe", "recipe_conv", "recipe_softmax")
FINAL = ("final",)


def build(name: str, args):
    import torch

    from linformer_lab.attention.config import AttentionConfig
    from linformer_lab.tasks.speech import SpeechRecognitionTask

    torch.manual_seed(0)
    # position_scale=1.0: the encodings at unit amplitude, as the old recipe had them (the
    # library default became 1/sqrt(d_model) because of these probes)
    kwargs = dict(encoder="transformer", d_model=96, n_layers=4, n_heads=3, dropout=0.0,
                  attention=AttentionConfig("linear", feature_map="elu"), positions="sinusoidal", position_scale=1.0)
    if name in ("softmax", "recipe_softmax"):
        kwargs["attention"] = AttentionConfig("softmax")
    if name == "bilstm":
        kwargs = dict(encoder="bilstm", lstm_hidden=96, lstm_layers=3, dropout=0.0)
    if name in ("small_sinusoidal", *FINAL):
        kwargs["position_scale"] = None  # the library default, 1/sqrt(d_model)
    if name == "learned_positions" or name in RECIPE:
        kwargs["positions"] = "learned"
    if name == "no_positions":
        kwargs["position_scale"] = 0.0
    if name in ("conv_frontend", "recipe_conv", *FINAL):
        kwargs["subsample"] = 2
    task = SpeechRecognitionTask(**kwargs)
    if name == "post_norm":  # no library option: the layers' forward is replaced for this probe
        for layer in task.model.transformer.layers:
            def forward(x, key_lengths=None, cu_seqlens=None, layer=layer):
                x = layer.norm_attention(x + layer.attention(x, key_lengths=key_lengths))
                return layer.norm_ff(x + layer.feedforward(x))
            layer.forward = forward
    return task


def evaluate(task, loader) -> float:
    import torch

    from linformer_lab.models.ctc import PhonemeErrorRate

    per = PhonemeErrorRate()
    task.eval()
    with torch.no_grad():
        for batch in loader:
            log_probs, lengths = task(batch["features"], batch["feature_lengths"])
            per.update(task.decode(log_probs, lengths), task.references(batch))
    task.train()
    return float(per.compute())


def run_probe(name: str, args) -> dict:
    import torch

    from linformer_lab.data.speech import SpeechDataModule

    torch.set_num_threads(1)
    dm = SpeechDataModule(hours=args.hours, batch_size=16 if name == "batch16" else args.batch_size,
                          seed=0, progress=False)
    dm.setup()
    task = build(name, args)
    lr = 1e-4 if name == "lr_paper" else 3e-3 if name == "lr_3e-3" else args.lr
    if name == "warmup" or name in RECIPE or name in FINAL:
        optimizer = torch.optim.Adam(task.parameters(), lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / args.warmup))
    elif name == "bilstm":
        optimizer, schedule = torch.optim.Adam(task.parameters(), lr=lr), None
    else:
        optimizer, schedule = torch.optim.RAdam(task.parameters(), lr=lr), None
    val = dm.val_dataloader()
    losses, pers, exit_update, running = [], [], None, None
    update, epoch, cpu0 = 0, 0, time.process_time()
    while update < args.updates:
        loader = dm.train_dataloader()
        loader.batch_sampler.set_epoch(epoch) if hasattr(loader.batch_sampler, "set_epoch") else None
        for batch in loader:
            loss = task.ctc_loss(batch)[0]
            optimizer.zero_grad()
            loss.backward()
            if name != "no_clip":
                torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            update += 1
            value = float(loss.detach())
            running = value if running is None else 0.9 * running + 0.1 * value
            if exit_update is None and running < args.plateau_exit:
                exit_update = update
            if update % 25 == 0:
                losses.append(round(running, 3))
            if update % args.eval_every == 0:
                pers.append(round(evaluate(task, val), 4))
                print(f"  {name}: update {update}, loss {running:.3f}, val PER {pers[-1]:.3f}", flush=True)
            if update >= args.updates:
                break
        epoch += 1
    return {"probe": name, "what": PROBES[name], "updates": update, "plateau_exit_update": exit_update,
            "final_loss": round(running, 3), "val_per": pers[-1] if pers else None, "val_per_curve": pers,
            "loss_curve": losses, "cpu_s": round(time.process_time() - cpu0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    parser.add_argument("--updates", type=int, default=600)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--plateau-exit", type=float, default=2.5)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2, help="probes run at once, one thread each")
    parser.add_argument("--state-dir", default="logs/speech_probes")
    parser.add_argument("--out", default="benchmarks/dev/results/speech_probes")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one probe, print JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_probe(args.one, args)), flush=True)
        return
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    todo = [p for p in args.probes if not (state / f"{p}.json").exists()]
    passthrough = [f"--updates={args.updates}", f"--hours={args.hours}", f"--batch-size={args.batch_size}",
                   f"--lr={args.lr}", f"--warmup={args.warmup}", f"--plateau-exit={args.plateau_exit}",
                   f"--eval-every={args.eval_every}"]
    running: list[tuple[str, subprocess.Popen]] = []
    while todo or running:
        while todo and len(running) < args.parallel:
            name = todo.pop(0)
            proc = subprocess.Popen([sys.executable, __file__, "--one", name, *passthrough],
                                    stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            running.append((name, proc))
        time.sleep(2)
        for name, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((name, proc))
            out = proc.stdout.read()
            result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
            print(out.replace("RESULT ", "").splitlines()[-1] if out else f"{name} failed", flush=True)
            if result is not None:
                (state / f"{name}.json").write_text(json.dumps(result))
    results = [json.loads((state / f"{p}.json").read_text()) for p in PROBES if (state / f"{p}.json").exists()]
    write_csv(args.out + ".csv", [{k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in r.items()}
                                  for r in results])
    info = machine_info()
    lines = [
        "# Speech probes: what keeps CTC transformers on the all-blank plateau",
        "",
        f"Generated by `benchmarks/dev/speech_probes.py --updates {args.updates} --hours {args.hours:g}` "
        f"({time.strftime('%Y-%m-%d')}); machine: {info['cpu']}, 1 torch thread per probe, "
        f"{args.parallel} probes at a time; torch {__import__('torch').__version__}. Reading: benchmarks/NOTES.md "
        f"(\"Which speech recipe learns on a CPU (Table 3)?\").",
        "",
        f"Linear transformer 4 x 3 x 32 unless the probe says otherwise; {args.updates} updates each; "
        f"plateau exit = first update with running training loss < {args.plateau_exit}.",
        "",
        "| probe | change | plateau exit (update) | loss at end | val PER % | val PER % every "
        f"{args.eval_every} updates | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['probe']} | {r['what']} | {r['plateau_exit_update'] or 'never'} | {r['final_loss']} | "
                     f"{100 * r['val_per']:.1f} | {' '.join(f'{100 * v:.1f}' for v in r['val_per_curve'])} | {r['cpu_s']} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
