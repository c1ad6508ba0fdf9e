// The printpress page: a prompt, settings, and the canvas drawn live as it denoises.
//
// Plain JavaScript, no build step. Three parts, each usable on its own so that more features (say,
// "select a span -> rewrite it in place") can be added beside them:
//   1. streamEvents(): POST a JSON body and read the server-sent events of the answer (any endpoint).
//   2. CanvasView: draws committed text plus one live canvas into an element (any number of views).
//   3. The page controller: draws the sampler settings' fields from the server's list of them, reads the form,
//      runs one generation, feeds a list of consumers.
// Everything is exposed on window.printpress for extensions and tests.
"use strict";

(function () {
  // ---------------------------------------------------------------------------------------------
  // 1. Server-sent events over fetch (EventSource cannot POST a body or send headers)
  // ---------------------------------------------------------------------------------------------

  /** POST `body` to `url` and call onEvent(name, data) for every SSE event until the stream ends. */
  async function streamEvents(url, body, { headers = {}, signal, onEvent }) {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...headers },
      body: JSON.stringify(body),
      signal,
    });
    if (!response.ok) {
      throw new Error(await errorMessage(response));
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const parsed = parseEvent(block);
        if (parsed) onEvent(parsed.name, parsed.data);
      }
    }
  }

  function parseEvent(block) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    return data.length ? { name, data: data.join("\n") } : null;
  }

  async function errorMessage(response) {
    try {
      const payload = await response.json();
      return `${response.status}: ${payload.error ? payload.error.message : JSON.stringify(payload)}`;
    } catch (_) {
      return `${response.status} ${response.statusText}`;
    }
  }

  function authHeaders(apiKey) {
    return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  }

  /**
   * Stream one completion with the step stream on; `consumer` may define any of
   * step(payload), commit(payload), text(delta), finish(choice, stats), usage(usage).
   */
  async function streamCompletion(body, consumer, { apiKey, signal } = {}) {
    const request = { ...body, stream: true, stream_steps: true, stream_options: { include_usage: true } };
    await streamEvents("/v1/completions", request, {
      headers: authHeaders(apiKey),
      signal,
      onEvent(name, data) {
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new Error(payload.error.message);
        if (name === "printpress.step") call(consumer, "step", payload);
        else if (name === "printpress.commit") call(consumer, "commit", payload);
        else {
          if (payload.usage) call(consumer, "usage", payload.usage);
          for (const choice of payload.choices || []) {
            if (choice.text) call(consumer, "text", choice.text);
            if (choice.finish_reason) call(consumer, "finish", choice, (payload.printpress || [])[0] || null);
          }
        }
      },
    });
  }

  function call(consumer, method, ...args) {
    if (typeof consumer[method] === "function") consumer[method](...args);
  }

  // ---------------------------------------------------------------------------------------------
  // 2. CanvasView: committed text, then the canvas being denoised
  // ---------------------------------------------------------------------------------------------

  const visible = (text) => text.replace(/\n/g, "⏎").replace(/\t/g, "⇥"); // one line: the canvas stays compact

  class CanvasView {
    /** `committedEl` receives the text, `canvasEl` one span per canvas position. */
    constructor(committedEl, canvasEl, { noiseView = () => "guess" } = {}) {
      this.committedEl = committedEl;
      this.canvasEl = canvasEl;
      this.noiseView = noiseView;
      this.pending = null; // the latest step, drawn at the next animation frame
    }

    reset(promptText = "") {
      this.committedEl.textContent = "";
      if (promptText) {
        const prompt = document.createElement("span");
        prompt.className = "prompt-text";
        prompt.textContent = promptText;
        this.committedEl.appendChild(prompt);
      }
      this.clearCanvas();
    }

    step(payload) {
      if (this.pending === null) requestAnimationFrame(() => this.draw());
      this.pending = payload;
    }

    draw() {
      const payload = this.pending;
      this.pending = null;
      if (!payload) return;
      const showNoise = this.noiseView() === "noise";
      const cells = payload.accepted.map((settled, i) => {
        const cell = document.createElement("span");
        cell.className = `tok ${settled ? "settled" : "renoised"}`;
        const text = settled || !showNoise ? payload.argmax_text[i] : payload.tokens_text[i];
        cell.textContent = visible(text);
        cell.dataset.position = String(i);
        return cell;
      });
      this.canvasEl.replaceChildren(...cells);
      this.canvasEl.dataset.canvas = String(payload.canvas);
      this.canvasEl.dataset.step = String(payload.step);
    }

    commit() {
      this.clearCanvas();
    }

    text(delta) {
      this.committedEl.appendChild(document.createTextNode(delta));
    }

    clearCanvas() {
      this.pending = null;
      this.canvasEl.replaceChildren();
    }
  }

  // ---------------------------------------------------------------------------------------------
  // 3. The page controller
  // ---------------------------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const form = $("generate-form");
  // The sampler settings the server takes, as GET /v1/settings lists them (the server writes the list into the page):
  // { name, kind, help, modes, editing, choices, default, min, max, step } each. The form's fields for them are
  // drawn from it, so a new setting appears here with no edit to the page.
  const SETTINGS = JSON.parse($("sampler-settings").textContent).data;
  // The page's own fields that go into a request body beside the settings (OpenAI's fields, not settings).
  const PAGE_FIELDS = { max_tokens: { kind: "int" }, seed: { kind: "int" } };
  const fieldsByName = { ...PAGE_FIELDS, ...Object.fromEntries(SETTINGS.map((s) => [s.name, s])) };

  /** A labelled input for one setting: a checkbox for a flag, a select for a choice, else a box for a number. */
  function settingField(s) {
    const label = document.createElement("label");
    label.title = s.help;
    label.dataset.modes = s.modes.join(" ");
    let input;
    if (s.choices) {
      input = document.createElement("select");
      for (const choice of ["", ...s.choices]) input.add(new Option(choice || `model default (${s.default})`, choice));
    } else {
      input = document.createElement("input");
      if (s.kind === "bool") {
        input.type = "checkbox";
        input.checked = s.default === true; // a box left at the model's default is not sent (`fieldValue`)
      } else {
        input.type = s.kind === "int" || s.kind === "float" ? "number" : "text";
        for (const bound of ["min", "max", "step"]) if (s[bound] != null) input[bound] = String(s[bound]);
        if (input.type === "number" && s.step == null) input.step = "any";
        input.placeholder = placeholder(s, form.elements.mode.value);
      }
    }
    input.name = s.name;
    label.append(`${s.name} `, input);
    return label;
  }

  /** What an empty box means for the chosen mode: the model's default, or the mode's own (`mode_defaults`). */
  function placeholder(s, mode) {
    const value = s.mode_defaults && mode in s.mode_defaults ? s.mode_defaults[mode] : s.default;
    return value === null ? "default" : `model default (${value})`;
  }

  /** A field per setting the form has no field for yet (the mode box is the page's own, with its own words). */
  function drawSettingFields() {
    $("sampler-fields").replaceChildren(...SETTINGS.filter((s) => !form.elements.namedItem(s.name)).map(settingField));
  }

  /** What a field asks for, typed by its setting's kind; undefined when it asks for nothing (empty, or a checkbox
   *  at the model's default): such a field is not sent and the model's default applies. */
  function fieldValue(field, input) {
    if (input.type === "checkbox") return input.checked === (field.default === true) ? undefined : input.checked;
    const raw = String(input.value).trim();
    if (raw === "") return undefined;
    if (field.kind === "int") return parseInt(raw, 10);
    if (field.kind === "float") return parseFloat(raw);
    return raw;
  }

  /** The values of the named fields (empty ones are left out: they keep the model's defaults; so are disabled ones,
   *  the settings the chosen mode does not read, unless `enabledOnly` is false). */
  function readFields(names, { enabledOnly = true } = {}) {
    const body = {};
    for (const name of names) {
      const input = form.elements.namedItem(name);
      if (!input || (enabledOnly && input.disabled)) continue;
      const value = fieldValue(fieldsByName[name] || {}, input);
      if (value !== undefined) body[name] = value;
    }
    return body;
  }

  /** The request body the form describes: the prompt, the page's fields and the settings of the chosen mode. */
  function readSettings() {
    return { prompt: form.elements.prompt.value, ...readFields(Object.keys(fieldsByName)) };
  }

  /** Enable the settings the chosen mode reads (`data-modes` on their label), disable the rest. */
  function applyMode() {
    const mode = form.elements.mode.value;
    for (const label of form.querySelectorAll("[data-modes]")) {
      const active = label.dataset.modes.split(" ").includes(mode);
      label.classList.toggle("inactive", !active);
      for (const input of label.querySelectorAll("input, select")) {
        input.disabled = !active;
        const s = fieldsByName[input.name];
        if (s && s.mode_defaults && input.type === "number") input.placeholder = placeholder(s, mode);
      }
    }
  }

  const pageOptions = () => {
    const data = new FormData(form);
    return { apiKey: String(data.get("api_key") || ""), delay: Number(data.get("delay") || 0),
             noiseView: String(data.get("noise_view")) };
  };

  const view = new CanvasView($("committed"), $("canvas"), { noiseView: () => pageOptions().noiseView });

  /** A consumer that keeps the status line, step counter and statistics up to date. */
  function statusConsumer() {
    let steps = 0;
    let completionTokens = null;
    let finalStats = null;
    const started = performance.now();
    return {
      step(payload) {
        steps += 1;
        $("steps-received").textContent = String(steps);
        $("progress").textContent = `canvas ${payload.canvas + 1} · step ${payload.step}/${payload.max_steps}` +
          ` · ${payload.accepted.filter(Boolean).length}/${payload.accepted.length} settled`;
      },
      usage(usage) {
        completionTokens = usage.completion_tokens;
        showStats(finalStats, completionTokens, performance.now() - started);
      },
      finish(choice, stats) {
        finalStats = stats;
        $("progress").textContent = `finished: ${choice.finish_reason}`;
        showStats(finalStats, completionTokens, performance.now() - started);
      },
    };
  }

  function showStats(stats, completionTokens, elapsedMs) {
    const rows = [];
    if (stats) {
      rows.push(["tokens/s", stats.tokens_per_second.toFixed(1)],
                ["tokens per forward", stats.tokens_per_forward.toFixed(2)],
                ["denoising steps", String(stats.denoising_steps)],
                ["canvases", String(stats.canvases)],
                ["generation time", `${stats.wall_time_s.toFixed(2)} s`],
                ["mode", stats.mode], ["seed", String(stats.seed)]);
    }
    if (completionTokens !== null) rows.push(["completion tokens", String(completionTokens)]);
    rows.push(["round trip", `${(elapsedMs / 1000).toFixed(2)} s`]);
    $("stats").replaceChildren(...rows.flatMap(([name, value]) => {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      dd.dataset.stat = name;
      return [dt, dd];
    }));
  }

  /**
   * Fan stream callbacks out to `consumers`; with `delay` > 0 they are replayed `delay` ms apart after each
   * step (to watch slowly). `drained()` resolves when all is shown, or rejects with AbortError on `signal`.
   */
  function paced(consumers, delay, signal) {
    const fanOut = (method, args) => consumers.forEach((c) => call(c, method, ...args));
    const aborted = () => new DOMException("stopped", "AbortError");
    let draining = Promise.resolve();
    const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
    const consumer = new Proxy({}, {
      get: (_, method) => (...args) => {
        if (!delay) return fanOut(method, args);
        draining = draining.then(async () => {
          if (signal.aborted) return;
          fanOut(method, args);
          if (method === "step") await sleep(delay);
        });
      },
    });
    const drained = () => new Promise((resolve, reject) => {
      if (signal.aborted) return reject(aborted());
      signal.addEventListener("abort", () => reject(aborted()), { once: true });
      draining.then(resolve);
    });
    return { consumer, drained };
  }

  let controller = null;

  /** Extra consumers (e.g. a second view) may be pushed here; each gets every stream callback. */
  const extraConsumers = [];

  async function run(event) {
    event.preventDefault();
    if (controller) return;
    const body = readSettings();
    const options = pageOptions();
    controller = new AbortController();
    setRunning(true);
    $("error").hidden = true;
    $("stats").replaceChildren();
    $("steps-received").textContent = "0";
    $("status").textContent = "generating";
    view.reset(body.prompt);
    const { consumer, drained } = paced([view, statusConsumer(), ...extraConsumers], options.delay,
                                          controller.signal);
    try {
      await streamCompletion(body, consumer, { apiKey: options.apiKey, signal: controller.signal });
      await drained();
      view.clearCanvas();
      $("status").textContent = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        $("status").textContent = "stopped";
      } else {
        $("status").textContent = "error";
        $("error").textContent = error.message;
        $("error").hidden = false;
      }
    } finally {
      controller = null;
      setRunning(false);
    }
  }

  function setRunning(running) {
    $("generate").disabled = running;
    $("stop").disabled = !running;
    document.body.dataset.running = running ? "1" : "0";
  }

  /** A button in the action bar, for features added later (e.g. rewrite the selected span). */
  function addAction(label, handler) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "secondary";
    button.textContent = label;
    button.addEventListener("click", handler);
    $("actions").appendChild(button);
    return button;
  }

  /** The served model's name, from /health (open without the API key, so it shows before any request). */
  async function showModel() {
    try {
      const response = await fetch("/health");
      if (response.ok) $("model-name").textContent = (await response.json()).model;
    } catch (_) {
      /* the page still works without the name */
    }
  }

  drawSettingFields();
  form.addEventListener("submit", run);
  form.elements.mode.addEventListener("change", applyMode);
  $("stop").addEventListener("click", () => controller && controller.abort());
  applyMode();
  showModel();

  window.printpress = { streamEvents, streamCompletion, authHeaders, CanvasView, readSettings, readFields, addAction,
                        extraConsumers, view, paced, setRunning, pageOptions, call, applyMode, SETTINGS };
})();
