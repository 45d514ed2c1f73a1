"""``fastvision benchmark``'s options checked against its ``--mode``: an option the mode does not read is
one line naming it (not dropped), and the mode-specific defaults are put in."""
from __future__ import annotations

from fastvision.errors import ConfigError


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--batch-sizes: expected comma-separated integers, got {text!r}") from None


# (option's dest, its flag, the modes that read it, its default there): an option given to a mode that does not
# read it is refused, not dropped (--cache in train mode compared no cache; --precision in data mode ran none)
MODE_FLAGS = (("cache", "--cache", ("data",), None), ("variant", "--variant", ("data",), None),
              ("rounds", "--rounds", ("data",), 4), ("seeds", "--seeds", ("target",), 5),
              ("seed", "--seed", ("target",), 0), ("nproc", "--nproc", ("target",), 1),
              ("target", "--target", ("target",), None), ("data", "--data", ("data", "target"), None),
              ("precision", "--precision", ("train", "inference"), None),
              ("compile", "--compile", ("train", "inference"), None),
              ("channels_last", "--channels-last / --no-channels-last", ("train", "inference"), None),
              ("augment", "--augment", ("train",), None),
              ("batch_sizes", "--batch-sizes", ("train", "inference", "data"), None),
              ("steps", "--steps", ("train", "inference", "data"), 50),
              ("warmup", "--warmup", ("train", "inference", "data"), None))
_WHAT = {"train": "times training steps on synthetic batches on the device",
         "inference": "times the validation forward on synthetic batches on the device",
         "data": "times the input path with the model removed", "target": "runs real training to a target"}


def check_mode_flags(args) -> None:
    """Refuse an option that ``args.mode`` does not read (one line naming it and the modes that do), then
    put in the defaults of the mode-specific ones left out.

    Raises:
        ConfigError: naming the option.
    """
    for dest, flag, modes, default in MODE_FLAGS:
        value = getattr(args, dest, None)
        given = value is not None if dest == "channels_last" else value not in (None, False, [], "")
        if given and args.mode not in modes:
            raise ConfigError(f"{flag} is for --mode {' / '.join(modes)}; --mode {args.mode} {_WHAT[args.mode]} "
                              "and does not read it")
        if value is None and default is not None:
            setattr(args, dest, default)
    if args.mode == "data" and args.batch_sizes and len(int_list(args.batch_sizes)) > 1:
        raise ConfigError(f"--batch-sizes {args.batch_sizes}: --mode data times one batch size (the loader's); "
                          "run it once per batch size")
