#!/usr/bin/env python3
"""Validate JSON files against runspool's JSON Schemas (draft 2020-12).

Reads one JSON object on stdin:

    {"schemas": "<dir of *.schema.json>",
     "checks": [{"label": "...", "schema": "status.schema.json#/$defs/written",
                 "file": "<path>" | "text": "<JSON text>", "jsonl": false}, ...]}

`schema` is a file in the schema directory, optionally with a JSON pointer
into it (`#/$defs/name`) to validate against one of its definitions. With
`jsonl`, every non-empty line is a document. Prints one JSON object per
check on stdout, in order: {"label", "errors": [...]} where `errors` is
empty when the document is valid; a document that is not JSON gets the
single error "not JSON: ...". Every schema is checked against the
metaschema first; an invalid schema is an error of every check that uses it.

Needs the `jsonschema` package (scripts/pyenv.sh installs it in a venv).
"""

import json
import math
import os
import sys

import jsonschema


def strict_loads(text):
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def load_validator(schema_dir, ref, cache):
    if ref in cache:
        return cache[ref]
    name, _, pointer = ref.partition("#")
    with open(os.path.join(schema_dir, name), encoding="utf-8") as f:
        root = json.load(f)
    jsonschema.Draft202012Validator.check_schema(root)
    schema = root
    if pointer:
        # A definition of the file, with the file's $defs in reach of its $refs.
        schema = {"$schema": root.get("$schema"), "$defs": root.get("$defs", {}), "$ref": "#" + pointer}
    v = jsonschema.Draft202012Validator(schema)
    cache[ref] = v
    return v


def describe(e):
    where = "/".join(str(p) for p in e.absolute_path)
    return f"at /{where}: {e.message[:300]} (schema {'/'.join(str(p) for p in e.absolute_schema_path)})"


def check_doc(validator, text):
    try:
        doc = strict_loads(text)
    except (ValueError, RecursionError) as e:
        return [f"not JSON: {str(e)[:200]}"]
    if isinstance(doc, float) and not math.isfinite(doc):
        return ["not JSON: a non-finite number"]
    try:
        return [describe(e) for e in validator.iter_errors(doc)][:5]
    except RecursionError:
        return ["nested too deep to validate"]


def main():
    job = json.load(sys.stdin)
    cache = {}
    out = []
    for c in job["checks"]:
        label = c.get("label", c.get("file", "?"))
        try:
            v = load_validator(job["schemas"], c["schema"], cache)
        except Exception as e:  # an unreadable or invalid schema fails the check
            out.append({"label": label, "errors": [f"schema {c['schema']}: {e}"[:500]]})
            continue
        if "text" in c:
            text = c["text"]
        else:
            try:
                with open(c["file"], "rb") as f:
                    text = f.read().decode("utf-8")
            except (OSError, UnicodeDecodeError) as e:
                out.append({"label": label, "errors": [f"unreadable: {e}"]})
                continue
        if c.get("jsonl"):
            errors = []
            for n, line in enumerate(text.split("\n"), 1):
                if line.strip():
                    errors += [f"line {n}: {e}" for e in check_doc(v, line)]
        else:
            errors = check_doc(v, text)
        out.append({"label": label, "errors": errors})
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
