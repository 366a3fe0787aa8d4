#!/usr/bin/env python3
"""The official `openai` Python client against `tprun serve` (CPU backend).

    python3 scripts/serve_openai_check.py BIN [--ranks N] [--model DIR]

Starts `BIN --ranks N --backend cpu serve --port 0`, then through the client: lists the model,
completes and chat-completes (greedy), streams both and checks the streamed text equals the
whole answer, and checks that an unknown model is a NotFoundError (404) and a negative
max_tokens a BadRequestError (400) while the server goes on. Exit 0 when all hold; stops the
server with SIGINT either way. Run by coordinator/tests/serve.rs when `openai` is installed
(.ci/run installs it).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading

import openai


def start(binary, ranks, model):
    cmd = [binary, "--ranks", str(ranks), "--backend", "cpu", "serve", "--port", "0"]
    if model:
        cmd += ["--model", model]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    addr = None
    for line in p.stderr:
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
        if "tprun serve: ready" in line:
            break
    if addr is None:
        p.kill()
        sys.exit("the server did not say where it listens")
    # Keep reading stderr so that the server never blocks on a full pipe.
    threading.Thread(target=lambda: p.stderr.read(), daemon=True).start()
    return p, addr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--model")
    a = ap.parse_args()
    proc, addr = start(a.binary, a.ranks, a.model)
    try:
        client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        want = os.path.basename(os.path.normpath(a.model)) if a.model else "tprun-default"
        assert model == want, (model, want)

        c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                      temperature=0)
        text = c.choices[0].text
        assert c.usage.completion_tokens <= 12 and c.choices[0].finish_reason in ("stop", "length")
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True))
        assert streamed == text, (streamed, text)

        msgs = [{"role": "user", "content": "Tell me a story"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        answer = r.choices[0].message.content
        assert r.choices[0].message.role == "assistant"
        parts = []
        for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                 temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
        assert "".join(parts) == answer, ("".join(parts), answer)

        try:
            client.completions.create(model="no-such-model", prompt="a", max_tokens=1)
            raise AssertionError("an unknown model was accepted")
        except openai.NotFoundError:
            pass
        try:
            client.completions.create(model=model, prompt="a", max_tokens=-1)
            raise AssertionError("a negative max_tokens was accepted")
        except openai.BadRequestError:
            pass
        again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                          temperature=0)
        assert again.choices[0].text == text
        print(f"openai {openai.__version__} against tprun serve ({a.ranks} rank(s)): "
              f"completion {text!r}, chat {answer!r}: ok")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
