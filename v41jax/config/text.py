"""Configs as text: the JSON round trip and `--set section.field=value` overrides.

`to_dict` / `from_dict` map any config dataclass to and from JSON-able dicts (tuples as
lists; unknown keys are an error naming them, the closest valid ones and the valid ones).
`override` changes single leaves, each parsed by its field's declared type, and validates
once at the end; an unknown key is a KeyError suggesting the closest keys and listing the
fields of the section it names (or the section names).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any

from v41jax.config import mhc as mhc_config
from v41jax.config.mhc import MHCConfig
from v41jax.config.schema import Config, ModelConfig


def inline(default_factory: Any, names: tuple[str, ...]) -> Any:
    """A field holding a sub-config of which only `names` are settings of the parent: they
    read and write as the parent's own keys (`to_dict`, `from_dict`, `override`, `diff`: a
    drafter's `train.lr` is its `train.optim.lr`), and the sub-config's other fields keep
    `default_factory()`'s values. So a config composes another's fields without declaring
    them again, and its JSON stays flat."""
    return dataclasses.field(default_factory=default_factory, metadata={"inline": tuple(names)})


def _inlined(f: dataclasses.Field) -> tuple[str, ...] | None:
    return f.metadata.get("inline")


def to_dict(cfg: Any) -> Any:
    """Config (or any nested dataclass) -> JSON-able dict; tuples become lists; the settings
    of an `inline` field are keys of the parent."""
    if dataclasses.is_dataclass(cfg):
        out = {}
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if (names := _inlined(f)) is not None:
                out.update({n: to_dict(getattr(value, n)) for n in names})
            else:
                out[f.name] = to_dict(value)
        return out
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    return cfg


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Build a value of declared type `tp` from its JSON form (used by from_dict)."""
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=key)
    if typing.get_origin(tp) is tuple:  # tuple[X, ...]
        return tuple(_coerce(typing.get_args(tp)[0], v, key) for v in value)
    return value


def from_dict(cls: type, d: dict, prefix: str = "") -> Any:
    """Inverse of `to_dict`; unknown keys are an error naming them and the valid ones."""
    hints = typing.get_type_hints(cls)
    inlined = {f.name: f for f in dataclasses.fields(cls) if _inlined(f) is not None}
    names = {f.name for f in dataclasses.fields(cls) if f.name not in inlined}
    names |= {n for f in inlined.values() for n in _inlined(f)}
    if cls is ModelConfig and "remat" in d:  # saved before remat_policy replaced the switch
        d = {k: v for k, v in d.items() if k != "remat"} | {
            "remat_policy": d.get("remat_policy", "full" if d["remat"] else "none")
        }
    if cls is MHCConfig and d.get("n_streams", 0):  # saved before a field existed: its old
        d = mhc_config.LEGACY_DEFAULTS | d  # behaviour (without mHC the fields mean nothing)
    if unknown := set(d) - names:
        close = {c for k in unknown for c in difflib.get_close_matches(k, names, n=3)}
        hint = f"did you mean {_or_list(sorted(close))}? " if close else ""
        raise KeyError(
            f"unknown config keys {sorted(unknown)} in {prefix or cls.__name__}; "
            f"{hint}valid: {sorted(names)}"
        )
    key = lambda k: f"{prefix}.{k}".lstrip(".")  # noqa: E731
    kwargs = {}
    for name, f in inlined.items():  # the sub-config: its defaults, then the given settings
        sub = typing.get_type_hints(hints[name])
        given = {n: _coerce(sub[n], d[n], key(n)) for n in _inlined(f) if n in d}
        kwargs[name] = dataclasses.replace(f.default_factory(), **given)
    own = {k: _coerce(hints[k], v, key(k)) for k, v in d.items() if k in hints}
    return cls(**own, **kwargs)


def diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences `key: old -> new` between two configs."""
    a, b = to_dict(old), to_dict(new)
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


def save_json(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=True)


def parse_json(raw: bytes | str, name: str) -> Any:
    """The JSON value of `raw`, the text of `name` (a file, or a part of one). Damaged text
    is a ValueError naming it, where it breaks and, when the text stops mid-value (a copy
    killed or a disk filled while writing), that it may be cut short: json's own message
    ("Unterminated string starting at: line 11 column 5") names no file."""
    if not raw.strip():
        raise ValueError(f"{name} is empty ({len(raw)} bytes), not JSON; it may be cut short")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not JSON text (byte {e.start} is not UTF-8)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # nothing structural after the break: the text stops inside a value
        rest = set(e.doc[e.pos :]) & set('{}[],:"')
        short = e.msg.startswith("Unterminated string") or not rest
        hint = "; it stops mid-value, so it may be cut short" if short else ""
        where = f"line {e.lineno} column {e.colno}: {e.msg}"
        raise ValueError(f"{name} is not valid JSON ({where}){hint}") from None


def read_json(path: Any) -> Any:
    """The JSON value of the file at `path` (a local path, or an `etils.epath.Path` such as
    a gs:// workdir's file), read whole; a damaged file is a ValueError naming it
    (`parse_json`). The one reader for the JSON files v41jax keeps in workdirs and reads
    from model directories."""
    if hasattr(path, "read_bytes"):
        return parse_json(path.read_bytes(), os.fspath(path))
    with open(path, "rb") as f:
        return parse_json(f.read(), os.fspath(path))


def load_json(path: Any) -> Config:
    """The Config saved in `path` (a run's config.json; local or an `etils.epath.Path`).
    Damaged JSON, a non-object or an unknown key is an error naming the file."""
    d = read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{os.fspath(path)} holds a JSON {type(d).__name__}, not a config")
    try:
        return from_dict(Config, d)
    except KeyError as e:
        raise KeyError(f"{os.fspath(path)}: {e.args[0]}") from None


def _leaf_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if (names := _inlined(f)) is not None:
            sub = typing.get_type_hints(tp)
            out.update({f"{prefix}{n}": sub[n] for n in names})
        elif dataclasses.is_dataclass(tp):
            out.update(_leaf_keys(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


def _or_list(keys: list[str]) -> str:
    """'a', 'a' or 'b', 'a', 'b' or 'c'."""
    quoted = [repr(k) for k in keys]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _children(leaves: dict[str, Any], section: str) -> list[str]:
    """The fields directly under `section` ("" = the top level): leaves as `a.b`, nested
    sections as `a.c.*`."""
    start = f"{section}." if section else ""
    out = set()
    for key in leaves:
        if key.startswith(start):
            head, dot, _ = key[len(start) :].partition(".")
            out.add(f"{start}{head}" + (".*" if dot else ""))
    return sorted(out)


def _unknown_key(key: str, leaves: dict[str, Any]) -> KeyError:
    """KeyError for an unknown `--set` key: the closest valid keys (difflib), then the fields of
    the deepest section the key names (or the top-level fields and sections)."""
    sections = {k.rsplit(".", 1)[0] for k in leaves if "." in k}
    sections |= {s.rsplit(".", 1)[0] for s in list(sections) if "." in s}
    parts = key.split(".")
    prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
    section = next((p for p in prefixes if p in sections), "")
    listing = f"valid keys of {section}" if section else "valid keys (sections end in .*)"
    listing += f": {', '.join(_children(leaves, section))}"
    if key in sections:
        return KeyError(f"config key {key!r} is a section, not a field; {listing}")
    leaf = parts[-1]
    if section:  # a misspelt field of a known section
        names = {c.rsplit(".", 1)[-1]: c for c in _children(leaves, section) if c[-1] != "*"}
        close = [names[n] for n in difflib.get_close_matches(leaf, list(names), n=3)]
    else:  # a misspelt section or top-level field
        close = difflib.get_close_matches(key, list(leaves), n=3)
    same = [k for k in leaves if k.rsplit(".", 1)[-1] == leaf]  # the field in another section
    close = list(dict.fromkeys(same + close))[:4]
    hint = f" (did you mean {_or_list(close)}?)" if close else ""
    return KeyError(f"unknown config key {key!r}{hint}; {listing}")


def _parse_scalar(tp: Any, text: str, key: str) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return _parse_scalar(args[0], text, key)
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {key}={text!r}: expected a bool (true/false)")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise ValueError(f"--set {key}={text!r}: expected {tp.__name__}") from None
    if tp is str or typing.get_origin(tp) is typing.Literal:  # a Literal: checked by validate
        return text
    raise ValueError(f"--set {key}: fields of type {tp} cannot be set from the command line")


def _parse_value(tp: Any, text: str, key: str) -> Any:
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if dataclasses.is_dataclass(item_tp):
            return _coerce(tp, json.loads(text), key)
        items = [s for s in text.split(",") if s.strip()]
        return tuple(_parse_scalar(item_tp, s.strip(), key) for s in items)
    return _parse_scalar(tp, text, key)


def override(cfg: Any, assignments: list[str]) -> Any:
    """Apply `["train.steps=24", "data.paths=a.txt,b/"]` to `cfg` (a `Config` or any frozen
    config dataclass, e.g. a drafter run's), each parsed by field type.

    Tuples take comma-separated items (an empty value is the empty tuple); tuples of
    dataclasses (e.g. optim.param_groups) take a JSON list of objects.
    """
    leaves = _leaf_keys(type(cfg))
    tree = to_dict(cfg)
    for assignment in assignments:
        if "=" not in assignment:
            example = assignment.strip() or "train.steps"
            raise ValueError(
                f"--set {assignment!r}: expected KEY=VALUE, e.g. --set {example}=VALUE "
                "(an empty value: KEY=)"
            )
        key, text = assignment.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"--set {assignment!r}: missing the KEY before '=' (KEY=VALUE)")
        if key not in leaves:
            raise _unknown_key(key, leaves)
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node[section]
        node[leaf] = to_dict(_parse_value(leaves[key], text, key))
    # Validated once, after all assignments: a change may need several fields to agree
    # (e.g. model.engram.max_ngram_size and model.engram.engram_vocab_size).
    return from_dict(type(cfg), tree)
