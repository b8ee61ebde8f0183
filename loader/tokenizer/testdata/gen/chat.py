# chat.py adds to ../chat_cases.json (written by chat.js) the renderings of
# Python's Jinja, the engine transformers' apply_chat_template runs, set up
# as transformers sets it up: a sandboxed environment with trim_blocks,
# lstrip_blocks and loop controls, its tojson filter and its
# raise_exception and strftime_now functions. Each case then holds both
# references: "python" (what transformers renders) and "js" (what
# @huggingface/jinja renders); loader/tokenizer/chat's test compares with
# the first, and this script prints where the two disagree.
#
# Run after chat.js, with Jinja2 3.1: python3 chat.py
import gzip
import json
import os
from datetime import datetime

import jinja2
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "..")


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

special_keys = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
templates, specials = {}, {}

path = os.path.join(out, "chat_cases.json")
with open(path, encoding="utf-8") as f:
    doc = json.load(f)
disagree = 0
for c in doc["cases"]:
    model = c["model"]
    if model not in templates:
        with gzip.open(os.path.join(out, model, "tokenizer_config.json.gz"), "rt", encoding="utf-8") as f:
            cfg = json.load(f)
        templates[model] = env.from_string(cfg["chat_template"])
        named = {}
        for k in special_keys:
            v = cfg.get(k)
            if isinstance(v, str):
                named[k] = v
            elif isinstance(v, dict) and isinstance(v.get("content"), str):
                named[k] = v["content"]
        specials[model] = named
    js = c.pop("js", None) or {k: c.pop(k) for k in ("text", "error") if k in c}
    c.pop("python", None)
    try:
        py = {"text": templates[model].render(**specials[model], **c.get("vars", {}), messages=c["messages"],
                                              add_generation_prompt=c["add_generation_prompt"])}
    except TemplateError as e:
        py = {"error": str(e)}
    c["python"], c["js"] = py, js
    if py != js:
        disagree += 1
        print(f"{model} / {c['name']} / add_generation_prompt={c['add_generation_prompt']}: python {py!r}, js {js!r}")

doc["generator"] = f"{doc['generator'].split(';')[0]}; Jinja2 {jinja2.__version__}"
with open(path, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=1, ensure_ascii=False)
    f.write("\n")
print(f"{len(doc['cases'])} cases, {disagree} where the references disagree")
