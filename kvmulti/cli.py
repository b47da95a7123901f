"""Command line: ``kvmulti info`` (what runs here and why), ``kvmulti build`` (native kernels now)
and ``kvmulti generate`` (the main job). Modules are imported by the command that needs them:
``kvmulti --help`` imports no torch."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__, settings


def collect_info() -> dict:
    """Everything ``kvmulti info`` reports, as plain data. Raises ValueError on a bad env var."""
    import torch

    from .backends.registry import available_backends, check_environment, dispatch_order, get_backend
    from .integrations import vllm as vllm_plugin
    from .platform import default_device, platform_of, torch_build
    check_environment()
    device = default_device()
    backends = {}
    for name, reasons in available_backends(device).items():
        runs_on = get_backend(name).describe()
        unique = [r for i, r in enumerate(reasons) if r not in reasons[:i] and r not in runs_on]
        backends[name] = {"usable": not reasons, "reasons": unique, "runs_on": runs_on}
    if device.type != "cpu":   # what the CPU-only verification paths say, too
        for name, reasons in available_backends("cpu").items():
            backends[name]["cpu_reasons"] = reasons
    return {
        "kvmulti": __version__,
        "torch": torch.__version__,
        "torch_build": torch_build(),
        "device": str(device),
        "platform": platform_of(device),
        "priority": list(dispatch_order(platform_of(device))),
        "backends": backends,
        "vllm": vllm_plugin.describe(),
        "env": settings.set_variables(),
    }


def print_info(info: dict) -> None:
    print(f"kvmulti {info['kvmulti']}   torch {info['torch']} ({info['torch_build']} build)")
    print(f"device: {info['device']}   platform: {info['platform']}")
    print(f"dispatch order here: {', '.join(info['priority'])}; any other usable backend runs only when named")
    print()
    width = max(len(n) for n in info["backends"])
    for name, entry in info["backends"].items():
        state = "usable" if entry["usable"] else "unusable"
        print(f"  {name:<{width}}  {state:<8}  {entry['runs_on']}")
        for reason in entry["reasons"]:
            print(f"  {'':<{width}}    - {reason}")
    print()
    print(f"vllm: {info['vllm']}")
    if info["env"]:
        print("environment:")
        for var, value in info["env"].items():
            print(f"  {var}={value}")
    else:
        print("environment: no kvmulti variables set (KVMULTI_ATTENTION_BACKEND, KVMULTI_DRAFT_ATTENTION_BACKEND, ...)")


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_info(info)
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (and ``--help`` for the rest), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


GENERATE_HELP = "speculative decoding: print the text, backends, acceptance and speed"


class VersionAction(argparse.Action):
    """``--version``: kvmulti's and torch's versions, looked up only when asked (no torch import)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib import metadata
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"kvmulti {__version__} (torch {torch_version})")
        parser.exit(0)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``generate``'s options (which import torch for the backend names) are added only
    when ``command`` is ``generate``."""
    from .build_cli import add_build_parser
    parser = OneLineParser(prog="kvmulti", description=__doc__)
    parser.add_argument("--version", action=VersionAction, help="show kvmulti's and torch's versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="platform, backends and why each is or is not usable here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    add_build_parser(sub)
    if command == "generate":
        from .generate_cli import add_generate_parser
        add_generate_parser(sub, GENERATE_HELP)
    else:
        sub.add_parser("generate", help=GENERATE_HELP, add_help=False)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command(argv)).parse_args(argv)
    try:
        settings.validate()
        code = args.func(args)
        sys.stdout.flush()      # inside the try: a reader that went away is seen here, not at exit
        return code
    except (ValueError, MemoryError) as error:     # user errors: one line, exit code 2
        print(f"kvmulti: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:      # the reader went away (``kvmulti generate x | head -1``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())     # Python's final flush of stdout must not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
