"""The web page at `/`: plain HTML and a little JavaScript, no build step.

A prompt box, model / LoRA / size / steps choices, a progress bar fed by the job's server-sent events (with
the latent preview where the model sends one), the result as an image or a looping video (MP4 in a
`<video>` element; a GIF request shows as an image), and a gallery of this browser's results kept in
localStorage.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{title}}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 1.5rem auto; padding: 0 1rem; }
 textarea { width: 100%; height: 4rem; }
 .row { display: flex; gap: .8rem; flex-wrap: wrap; margin: .6rem 0; align-items: end; }
 label { display: flex; flex-direction: column; font-size: .85rem; }
 progress { width: 100%; height: 1.2rem; }
 #result img, #result video, #preview img { image-rendering: pixelated; width: 256px; border: 1px solid #ccc; }
 #gallery { display: flex; flex-wrap: wrap; gap: .4rem; }
 #gallery img, #gallery video { width: 96px; image-rendering: pixelated; border: 1px solid #ddd; }
 .error { color: #b00; }
</style></head>
<body>
<h1>{{title}}</h1>
<form id="form">
 <textarea id="prompt" placeholder="a red circle in the top left on a white background"></textarea>
 <div class="row">
  <label>model <select id="model"></select></label>
  <label>LoRA <select id="lora"><option value="">none</option></select></label>
  <label>LoRA scale <input id="lora_scale" type="number" step="0.1" value="1.0" style="width:5rem"></label>
  <label>size <input id="size" value="" style="width:6rem"></label>
  <label>steps <input id="steps" type="number" min="1" value="20" style="width:5rem"></label>
  <label>seed <input id="seed" type="number" min="0" value="0" style="width:6rem"></label>
  <label>token <input id="token" type="password" style="width:8rem"></label>
  <button id="go" type="submit">Generate</button>
  <button id="stop" type="button" disabled>Cancel</button>
 </div>
</form>
<progress id="bar" max="1" value="0"></progress>
<div id="status">idle</div>
<div class="row"><div id="preview"></div><div id="result"></div></div>
<h2>Gallery</h2>
<div id="gallery"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let models = [], current = null;
window.mdProgress = [];  // the steps the bar was set to, in order (for tests and debugging)
const auth = () => $("token").value ? {"Authorization": "Bearer " + $("token").value} : {};
const q = () => $("token").value ? "?token=" + encodeURIComponent($("token").value) : "";

function media(src) {
  // An MP4 result plays in a muted looping <video>; images and GIFs are <img>.
  const video = src.startsWith("data:video/");
  const el = document.createElement(video ? "video" : "img");
  if (video) { el.autoplay = true; el.loop = true; el.muted = true; el.playsInline = true; }
  el.src = src; return el;
}
function gallery() {
  const items = JSON.parse(localStorage.getItem("md-gallery") || "[]");
  $("gallery").replaceChildren(...items.map((it) => {
    const el = media(it.src); el.title = it.prompt; return el;
  }));
}
function remember(src, prompt) {
  const items = JSON.parse(localStorage.getItem("md-gallery") || "[]");
  items.unshift({src, prompt});
  // localStorage holds a few MB: when it is full, the oldest results go first.
  for (let keep = Math.min(items.length, 24); keep > 0; keep--) {
    try { localStorage.setItem("md-gallery", JSON.stringify(items.slice(0, keep))); break; }
    catch (e) { if (keep === 1) console.warn("gallery: result too large to keep", e); }
  }
  gallery();
}
function pickModel() {
  const m = models.find((x) => x.id === $("model").value); if (!m) return;
  $("size").value = m.default_size;
  $("lora").replaceChildren(new Option("none", ""), ...m.loras.map((l) => new Option(l, l)));
}
async function loadModels() {
  const r = await fetch("/v1/models", {headers: auth()});
  if (!r.ok) { $("status").textContent = "models: " + r.status; return; }
  models = (await r.json()).data;
  $("model").replaceChildren(...models.map((m) => new Option(m.id + " (" + m.kind + ")", m.id)));
  pickModel();
}
$("model").addEventListener("change", pickModel);
$("token").addEventListener("change", loadModels);
$("stop").addEventListener("click", async () => {
  if (current) await fetch("/v1/jobs/" + current, {method: "DELETE", headers: auth()});
});
$("form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const m = models.find((x) => x.id === $("model").value);
  const body = {prompt: $("prompt").value, model: m.id, size: $("size").value,
                steps: parseInt($("steps").value, 10), seed: parseInt($("seed").value, 10), wait: false};
  if ($("lora").value) body.loras = [{name: $("lora").value, scale: parseFloat($("lora_scale").value)}];
  const kind = m.kind === "video" ? "videos" : "images";
  $("status").className = ""; $("status").textContent = "submitting";
  $("bar").value = 0; $("result").replaceChildren(); window.mdProgress = [];
  const r = await fetch("/v1/" + kind + "/generations",
    {method: "POST", headers: {"Content-Type": "application/json", ...auth()}, body: JSON.stringify(body)});
  const job = await r.json();
  if (!r.ok) { $("status").className = "error"; $("status").textContent = job.error.message; return; }
  current = job.id; $("go").disabled = true; $("stop").disabled = false;
  const es = new EventSource("/v1/jobs/" + job.id + "/events" + q());
  es.addEventListener("running", () => { $("status").textContent = "running"; });
  es.addEventListener("progress", (e) => {
    const d = JSON.parse(e.data);
    $("bar").max = d.total; $("bar").value = d.step; window.mdProgress.push(d.step);
    $("status").textContent = "step " + d.step + " of " + d.total;
    if (d.preview) {
      const img = document.createElement("img"); img.src = "data:image/png;base64," + d.preview;
      $("preview").replaceChildren(img);
    }
  });
  const finish = async (e) => {
    es.close(); $("go").disabled = false; $("stop").disabled = true; current = null;
    const done = await (await fetch("/v1/jobs/" + job.id, {headers: auth()})).json();
    $("status").textContent = done.status + (done.error ? ": " + done.error : "");
    for (const item of done.data || []) {
      const el = media("data:" + item.mime_type + ";base64," + item.b64_json); el.className = "result";
      $("result").appendChild(el); remember(el.src, body.prompt);
    }
  };
  for (const name of ["succeeded", "failed", "cancelled"]) es.addEventListener(name, finish);
});
gallery(); loadModels();
</script>
</body></html>
"""
