"""Command line: ``kvmulti info`` (what runs here and why) and ``kvmulti generate`` (the main job)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import __version__, settings
from .backends.registry import (ENV_BACKEND, ENV_DRAFT_BACKEND, available_backends, check_environment,
                                dispatch_order, get_backend)
from .integrations import vllm as vllm_plugin
from .platform import default_device, platform_of, torch_build


def collect_info() -> dict:
    """Everything ``kvmulti info`` reports, as plain data. Raises ValueError on a bad env var."""
    check_environment()
    device = default_device()
    backends = {}
    for name, reasons in available_backends(device).items():
        backend = get_backend(name)
        backends[name] = {"usable": not reasons, "reasons": reasons, "runs_on": backend.describe()}
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
        print(f"environment: no kvmulti variables set ({ENV_BACKEND}, {ENV_DRAFT_BACKEND}, ...)")


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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvmulti", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvmulti {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="platform, backends and why each is or is not usable here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    try:
        from .generate_cli import add_generate_parser
    except ImportError:   # the model runner is optional in a partial install
        pass
    else:
        add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MemoryError) as error:     # user errors: one line, exit code 2
        print(f"kvmulti: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
