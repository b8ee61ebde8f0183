// chat.js writes ../chat_cases.json, the reference renderings of the chat
// templates in ../MODEL/tokenizer_config.json.gz that loader/tokenizer/chat's
// tests compare with, made by @huggingface/jinja (the Jinja engine of
// transformers.js, pinned in package.json) the way transformers'
// apply_chat_template renders them: the conversation as messages,
// add_generation_prompt, the config's named special tokens (bos_token,
// eos_token, ...) and any extra variables; a template that calls
// raise_exception records its message.
//
// Run: cd loader/tokenizer/testdata/gen && npm ci && node chat.js
"use strict";

const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const { Template } = require("@huggingface/jinja");

const out = path.resolve(__dirname, "..");
const jinjaVersion = JSON.parse(fs.readFileSync(path.join(__dirname, "node_modules/@huggingface/jinja/package.json"))).version;
const models = ["llama3", "qwen3", "llama2", "mistral_nemo"];
const specialKeys = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

const sys = { role: "system", content: "You are a terse assistant." };
const user = (content) => ({ role: "user", content });
const assistant = (content) => ({ role: "assistant", content });

// The conversations: each rendered with and without the generation prompt.
const conversations = [
  { name: "one user turn", messages: [user("Hello!")] },
  { name: "system and user", messages: [sys, user("What is 2+2?")] },
  {
    name: "several turns",
    messages: [sys, user("Name a colour."), assistant("Blue."), user("Another one?")],
  },
  {
    name: "awkward content",
    messages: [user("  spaces around  \n\ttabs, é, 🤗, {{ braces }}, {% tags %} and \"quotes\"\n\n")],
  },
  { name: "special token text in content", messages: [user("a <|eot_id|> b <|im_end|> c </s> d [INST] e")] },
  { name: "assistant last", messages: [user("Count to three."), assistant("One, two,")] },
  { name: "two user turns in a row", messages: [user("First."), user("Second.")] },
  { name: "unknown role", messages: [{ role: "critic", content: "Hmm." }] },
  {
    name: "reasoning in an earlier answer",
    messages: [user("Think first."), assistant("<think>\nsome reasoning\n</think>\n\nThe answer."), user("And now?")],
  },
  { name: "no thinking", messages: [user("Quick answer.")], vars: { enable_thinking: false }, only: ["qwen3"] },
];

function specialTokens(cfg) {
  const named = {};
  for (const k of specialKeys) {
    const v = cfg[k];
    if (typeof v === "string") {
      named[k] = v;
    } else if (v && typeof v.content === "string") {
      named[k] = v.content;
    }
  }
  return named;
}

const cases = [];
for (const model of models) {
  const cfg = JSON.parse(zlib.gunzipSync(fs.readFileSync(path.join(out, model, "tokenizer_config.json.gz"))));
  if (typeof cfg.chat_template !== "string") {
    continue; // no template: the Go test checks that there is none
  }
  const tmpl = new Template(cfg.chat_template);
  for (const conv of conversations) {
    if (conv.only && !conv.only.includes(model)) {
      continue;
    }
    for (const addGenerationPrompt of [true, false]) {
      const c = { model, name: conv.name, messages: conv.messages, add_generation_prompt: addGenerationPrompt };
      if (conv.vars) {
        c.vars = conv.vars;
      }
      try {
        c.text = tmpl.render({ ...specialTokens(cfg), ...(conv.vars || {}), messages: conv.messages, add_generation_prompt: addGenerationPrompt });
      } catch (e) {
        c.error = String(e.message);
      }
      cases.push(c);
    }
  }
}

fs.writeFileSync(
  path.join(out, "chat_cases.json"),
  JSON.stringify({ generator: `@huggingface/jinja ${jinjaVersion}`, cases }, null, 1) + "\n",
);
console.log(`wrote ${cases.length} chat cases`);
