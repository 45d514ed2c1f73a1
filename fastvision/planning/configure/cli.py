"""``fastvision configure DATA``: the subcommand's arguments, and its outputs (the table, the recipe
YAML, the plan as JSON) around :func:`fastvision.planning.configure.planner.configure`."""
from __future__ import annotations

from pathlib import Path

from fastvision.planning.configure import rules
from fastvision.planning.configure.planner import configure
from fastvision.planning.configure.recipe import plan_json, table, write_recipe


def add_cli(subparsers) -> None:
    """``fastvision configure DATA``."""
    p = subparsers.add_parser("configure", help="plan a 3-D segmentation recipe from a Decathlon dataset and a GPU "
                                                "(spacing, normalisation, patch, network, batch), nnU-Net's rules",
                              description="Fingerprint the dataset, choose target spacing, normalisation, patch, "
                                          "pooling per axis, stages and the batch that fits the GPU, and write a "
                                          "recipe that extends a shipped one, each value commented with its rule.")
    p.add_argument("data", help="Decathlon folder (dataset.json, imagesTr/, labelsTr/)")
    p.add_argument("--gpu", help="GPU to fit (a `plan` GPU name; default: this machine's CUDA device, else A100-80GB)")
    p.add_argument("--memory", help="memory budget instead of --gpu, e.g. 24GiB")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs of the job: the planned (global) batch is split over them; also states the CPU "
                        "workers each GPU needs (default 1)")
    p.add_argument("--base", default="unet3d", choices=sorted(rules.BASES), help="network family (default unet3d)")
    p.add_argument("--trainer", default=None, metavar="{fast,nnunet}",
                   help="training written: nnunet (nnUNetTrainer's optimizer, poly schedule, Dice+CE with deep "
                        "supervision, augmentation, iterations; default for unet3d) or fast (the base recipe's; "
                        "default for segresnet)")
    p.add_argument("--out", type=Path, help="write the recipe YAML here (default: print the table only)")
    p.add_argument("--json", type=Path, help="also write the plan as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out / --json file")
    p.set_defaults(func=cmd_configure)


def cmd_configure(args) -> int:
    from fastvision.api import refuse_overwrite

    for path, flag in ((args.out, "--out"), (args.json, "--json")):
        if path:
            refuse_overwrite(path, args.force, flag)  # before the fingerprint: nothing is lost or redone
    plan = configure(args.data, gpu=args.gpu, memory=args.memory, base=args.base, gpus=args.gpus,
                     trainer=args.trainer)
    # the files first: a reader that stops early (`| head`) must not cost the recipe
    if args.out:
        write_recipe(plan, args.out)
    if args.json:
        from fastvision.utils.files import atomic_text

        atomic_text(args.json, plan_json(plan))
    print(table(plan))  # the CLI's output
    if args.out:
        print(f"wrote {args.out}; train it with: fastvision train {args.out}")
    if args.json:
        print(f"wrote {args.json}")
    return 0
