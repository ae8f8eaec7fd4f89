// The gateway's page: draw a mask on a template, submit the edit, follow it, browse results.
// Every call carries the API key in an Authorization header (kept in sessionStorage for this tab
// only), so events are read with fetch() as a stream: EventSource cannot send headers.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("stencil-key") || "", file: null, templateId: "", drawing: false };

async function api(path, options = {}) {
  const headers = Object.assign({ Authorization: `Bearer ${state.key}` }, options.headers || {});
  const resp = await fetch(path, Object.assign({}, options, { headers }));
  if (!resp.ok) {
    let message = `HTTP ${resp.status}`;
    try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return resp;
}

function say(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function useKey(key) {
  state.key = key;
  sessionStorage.setItem("stencil-key", key);
  try {
    const me = await (await api("/v1/me")).json();
    $("who").textContent = `tenant ${me.tenant} (${me.scopes.join(", ")})`;
    $("who").dataset.tenant = me.tenant;
    await Promise.all([loadTemplates(), loadGallery()]);
    updateSubmit();
  } catch (err) {
    $("who").textContent = "";
    say(`key refused: ${err.message}`, true);
  }
}

async function drawTemplate(blob) {
  const bitmap = await createImageBitmap(blob);
  for (const id of ["image-canvas", "mask-canvas"]) {
    $(id).width = bitmap.width;
    $(id).height = bitmap.height;
  }
  $("canvas-wrap").style.aspectRatio = `${bitmap.width} / ${bitmap.height}`;
  $("image-canvas").getContext("2d").drawImage(bitmap, 0, 0);
  $("mask-canvas").dataset.loaded = "1";
  updateSubmit();
}

async function loadTemplates() {
  const { templates } = await (await api("/v1/templates")).json();
  const box = $("stored-templates");
  box.replaceChildren(...templates.slice(0, 12).map((id) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = id.length > 14 ? id.slice(0, 14) + "…" : id;
    b.title = id;
    b.addEventListener("click", async () => {
      state.file = null;
      state.templateId = id;
      await drawTemplate(await (await api(`/v1/templates/${encodeURIComponent(id)}/image`)).blob());
    });
    return b;
  }));
}

function paint(event) {
  const canvas = $("mask-canvas");
  const rect = canvas.getBoundingClientRect();
  const x = (event.clientX - rect.left) * (canvas.width / rect.width);
  const y = (event.clientY - rect.top) * (canvas.height / rect.height);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "rgba(255, 40, 40, 0.55)";
  ctx.beginPath();
  ctx.arc(x, y, Number($("brush").value) * (canvas.width / rect.width) / 2, 0, 2 * Math.PI);
  ctx.fill();
  canvas.dataset.painted = "1";
  updateSubmit();
}

function maskBlob() {
  // White where painted, transparent elsewhere. A canvas PNG has an alpha channel, and the service
  // reads an RGBA mask from its alpha (opaque = edit).
  const src = $("mask-canvas");
  const data = src.getContext("2d").getImageData(0, 0, src.width, src.height);
  for (let i = 0; i < data.data.length; i += 4) {
    data.data[i] = data.data[i + 1] = data.data[i + 2] = 255;
    data.data[i + 3] = data.data[i + 3] > 0 ? 255 : 0;
  }
  const out = document.createElement("canvas");
  out.width = src.width;
  out.height = src.height;
  out.getContext("2d").putImageData(data, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

function updateSubmit() {
  $("submit").disabled = !(state.key && (state.file || state.templateId) && $("mask-canvas").dataset.painted);
}

function logProgress(job) {
  const text = job.status === "denoising" || job.progress.step > 0
    ? `${job.status} ${job.progress.step}/${job.progress.total}` : job.status;
  $("progress").max = Math.max(1, job.progress.total);
  $("progress").value = job.progress.step;
  say(`job ${job.id}: ${text}${job.error ? ` (${job.error})` : ""}`, job.status === "failed");
  const previous = $("progress-log").lastElementChild;
  if (previous && previous.textContent === text) return;
  const li = document.createElement("li");
  li.textContent = text;
  li.dataset.status = job.status;
  li.dataset.step = job.progress.step;
  li.dataset.total = job.progress.total;
  $("progress-log").append(li);
}

async function follow(jobId) {
  // Server-sent events over fetch: "event: update" / "data: <job>" blocks until the job ends.
  const resp = await api(`/v1/jobs/${jobId}/events`);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let last = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (!data) continue;
      const event = block.split("\n").find((l) => l.startsWith("event:"));
      if (event && event.includes("error")) throw new Error(JSON.parse(data).message);
      last = JSON.parse(data);
      logProgress(last);
    }
  }
  return last;
}

async function submitEdit() {
  $("submit").disabled = true;
  $("progress-log").replaceChildren();
  $("result").removeAttribute("src");
  try {
    const form = new FormData();
    if (state.file) form.append("template", state.file, state.file.name);
    else form.append("template_id", state.templateId);
    form.append("mask", await maskBlob(), "mask.png");
    form.append("prompt", $("prompt").value);
    form.append("steps", $("steps").value);
    form.append("seed", $("seed").value);
    form.append("keep_unmasked", "true");
    const job = await (await api("/v1/edits", { method: "POST", body: form })).json();
    $("result").dataset.jobId = job.id;
    logProgress(job);
    const end = await follow(job.id);
    if (end && end.status === "done") {
      $("result").src = URL.createObjectURL(await (await api(end.result_url)).blob());
      $("result").alt = `result of ${job.id}`;
      await loadGallery();
    }
  } catch (err) {
    say(err.message, true);
  } finally {
    updateSubmit();
  }
}

async function loadGallery() {
  const { jobs } = await (await api("/v1/jobs?status=done&limit=12")).json();
  const figures = await Promise.all(jobs.map(async (job) => {
    const fig = document.createElement("figure");
    const img = document.createElement("img");
    img.alt = job.record.prompt || job.id;
    img.src = URL.createObjectURL(await (await api(job.result_url)).blob());
    img.dataset.jobId = job.id;
    const cap = document.createElement("figcaption");
    cap.textContent = `${job.record.prompt || "(no prompt)"} · ${job.progress.total} steps`;
    fig.append(img, cap);
    return fig;
  }));
  $("gallery").replaceChildren(...figures);
}

window.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = state.key;
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); useKey($("api-key").value.trim()); });
  $("template-file").addEventListener("change", async (e) => {
    state.file = e.target.files[0] || null;
    state.templateId = "";
    if (state.file) await drawTemplate(state.file);
  });
  const mask = $("mask-canvas");
  mask.addEventListener("pointerdown", (e) => { state.drawing = true; mask.setPointerCapture(e.pointerId); paint(e); });
  mask.addEventListener("pointermove", (e) => { if (state.drawing) paint(e); });
  mask.addEventListener("pointerup", () => { state.drawing = false; });
  $("clear-mask").addEventListener("click", () => {
    mask.getContext("2d").clearRect(0, 0, mask.width, mask.height);
    delete mask.dataset.painted;
    updateSubmit();
  });
  $("submit").addEventListener("click", submitEdit);
  $("refresh").addEventListener("click", () => loadGallery().catch((err) => say(err.message, true)));
  if (state.key) useKey(state.key);
});
