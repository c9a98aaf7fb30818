"""Prometheus text from several replicas as one exposition: every sample gets a ``replica`` label, and
each metric family's ``# HELP`` / ``# TYPE`` lines appear once, followed by every replica's samples."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def with_label(text: str, key: str, value: str) -> str:
    """``text`` with ``key="value"`` added to every sample's labels."""
    label = f'{key}="{value}"'
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or m is None:
            out.append(line)
            continue
        name, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f"{name}{{{label}{',' if inner else ''}{inner}}}{rest}")
    return "\n".join(out) + "\n"


def merge(texts: list[str]) -> str:
    """One exposition from several: families in first-seen order, each header once."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    order: list[str] = []
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in headers:
                    headers[family], samples[family] = [], []
                    order.append(family)
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
            elif line.strip() and family is not None:
                samples[family].append(line)
    return "".join("\n".join(headers[f] + samples[f]) + "\n" for f in order)
