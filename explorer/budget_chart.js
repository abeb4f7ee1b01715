// The budget chart (see budget_chart.py): the DP front lives here, the slider is the budget.
//
// While the pointer moves, every step is drawn in the page: the bars, the uniform line and
// the current point are restyled with zero-duration, no-redraw animations (the cheap path
// of plotly.js) and the readout is plain HTML. Nothing goes to the server until the
// pointer is released; then the released step is sent back as the "release" trigger.
//
// Until the server's data comes back at the step the user chose, the chart says so
// ("pending") and keeps that step: data from a run that started before the release (or
// before later keys) no longer pulls the thumb back, and keys pressed meanwhile count. The
// step chosen and not yet confirmed is also kept in the tab's sessionStorage (UNSAVED): the
// keeper that app.py mounts on every other page (budget_chart.py, KEEPER_JS) sends it from
// there when the user left the planner before it reached the server (keys are sent once they
// stop, and a page link clicked in between used to drop them), and this chart sends it again
// after a reload of the planner.

const PLOT_CONFIG = { displayModeBar: false, responsive: true, scrollZoom: false };
const NO_REDRAW = { mode: "immediate", transition: { duration: 0 }, frame: { duration: 0, redraw: false } };
const KEY_RELEASE_MS = 400; // keys step one row at a time; the budget is sent once they stop
const UNSAVED = "gap-budget-unsaved"; // sessionStorage: the step shown and not yet the server's

function readUnsaved() {
  try {
    return JSON.parse(window.sessionStorage.getItem(UNSAVED) || "null");
  } catch (error) {
    return null; // storage off or a value written by something else: nothing to keep
  }
}

function stepId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
}

function writeUnsaved(value) {
  try {
    if (value === null) window.sessionStorage.removeItem(UNSAVED);
    else window.sessionStorage.setItem(UNSAVED, JSON.stringify(value));
  } catch (error) {
    // storage off: a page switch right after the keys may then lose them, as it did before
  }
}

function waitForPlotly(timeoutMs = 60000) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  return new Promise((resolve, reject) => {
    const started = performance.now();
    const poll = () => {
      if (window.Plotly) resolve(window.Plotly);
      else if (performance.now() - started > timeoutMs) reject(new Error("plotly.js did not load"));
      else setTimeout(poll, 20);
    };
    poll();
  });
}

function element(tag, className, parent, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function build(parent) {
  const root = element("div", "gap-budget", parent);
  root.dataset.testid = "gap-budget-chart";
  const head = element("div", "gap-budget-head", root);
  const label = element("label", "gap-budget-label", head,
    "Budget: share of the prunable parameters (attention and MLP projections) to remove");
  const slider = element("input", "gap-budget-slider", head);
  slider.type = "range";
  slider.step = "any";
  slider.id = `gap-budget-slider-${Math.random().toString(36).slice(2)}`;
  label.htmlFor = slider.id;
  const readout = element("div", "gap-budget-readout", head);
  readout.setAttribute("aria-live", "polite");
  const value = element("span", "gap-budget-value", readout);
  element("span", "gap-budget-of", readout, "of prunable");
  const removed = element("span", "gap-budget-chip", readout);
  removed.dataset.k = "removed";
  const left = element("span", "gap-budget-chip", readout);
  left.dataset.k = "left";
  const loss = element("span", "gap-budget-chip", readout);
  loss.dataset.k = "loss";
  const status = element("span", "gap-budget-status", readout);
  const legend = element("div", "gap-budget-legend", root);
  const panels = element("div", "gap-budget-panels", root);
  const ratesPanel = element("figure", "gap-budget-panel", panels);
  element("figcaption", null, ratesPanel, "Pruning rate per layer");
  const rates = element("div", "gap-budget-plot gap-budget-rates", ratesPanel);
  const frontPanel = element("figure", "gap-budget-panel", panels);
  const frontCaption = element("figcaption", null, frontPanel, "Predicted loss increase vs budget");
  const frontArea = element("div", "gap-budget-area", frontPanel);
  const front = element("div", "gap-budget-plot gap-budget-front", frontArea);
  // The chosen point is a positioned dot, not a trace: moving it costs no plotly.js call.
  const dot = element("div", "gap-budget-dot", frontArea);
  return { root, slider, readout, value, removed, left, loss, status, legend, rates, front, dot, frontCaption };
}

function drawLegend(node, items) {
  node.replaceChildren();
  for (const item of items) {
    const entry = element("span", "gap-budget-key", node);
    const swatch = element("span", `gap-budget-swatch gap-budget-swatch-${item.shape}`, entry);
    swatch.style.setProperty("--swatch", item.color);
    element("span", null, entry, item.label);
  }
}

function nearestStep(budgets, percent) {
  const target = percent / 100;
  let lo = 0;
  let hi = budgets.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (budgets[mid] < target) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && Math.abs(budgets[lo - 1] - target) <= Math.abs(budgets[lo] - target)) return lo - 1;
  return lo;
}

function formatCount(n) {
  return n.toLocaleString("en-US");
}

class BudgetChart {
  constructor(parent, setTriggerValue) {
    this.ui = build(parent);
    this.setTriggerValue = setTriggerValue;
    this.data = null;
    this.version = null;
    this.wanted = null;
    this.shown = null;
    this.busy = false;
    this.dragging = false;
    this.deferred = null;
    this.keyTimer = null;
    this.sent = null; // the step of the release sent and not yet confirmed by the server's data
    this.frontBox = null; // where the front's plot area is (measureFront)
    const { slider } = this.ui;
    slider.addEventListener("pointerdown", () => { this.dragging = true; });
    // A press that does not move the thumb fires no "change": end the drag on any pointer up.
    this.onPointerUp = () => setTimeout(() => this.endDrag(), 50);
    window.addEventListener("pointerup", this.onPointerUp);
    slider.addEventListener("input", () => {
      if (this.data) this.request(nearestStep(this.data.budgets, Number(slider.value)));
    });
    slider.addEventListener("change", () => { if (this.data) this.release(); });
    slider.addEventListener("keydown", (event) => this.key(event));
    const resize = new ResizeObserver(() => {
      if (!window.Plotly) return;
      for (const gd of [this.ui.rates, this.ui.front]) {
        // A chart of a page left behind (or a collapsed panel) is not displayed: plotly.js
        // rejects resizing it ("Resize must be passed a displayed plot div element").
        if (!gd.data || !gd.isConnected || gd.offsetParent === null || gd.clientWidth === 0) continue;
        window.Plotly.Plots.resize(gd).catch(() => {});
      }
    });
    resize.observe(this.ui.rates);
    resize.observe(this.ui.front);
    this.resizeObserver = resize;
  }

  async update(data) {
    if (data.version === this.version) return;
    if (this.dragging) { this.deferred = data; return; }
    const Plotly = await waitForPlotly();
    const previous = this.data;
    this.data = data;
    this.version = data.version;
    const { slider, rates, front, legend, frontCaption, status } = this.ui;
    // The user's step stands while keys are still to be sent, or while a release is on its way
    // and this data is from before it; data of another front (table, constraints) resets it.
    const sameFront = previous && previous.front_id === data.front_id;
    if (!sameFront) {
      clearTimeout(this.keyTimer);
      this.keyTimer = null;
      this.sent = null;
    } else if (this.sent !== null && data.active === this.sent) {
      this.sent = null; // the server has the released step
    }
    let keep = sameFront && this.wanted !== null && (this.keyTimer !== null || this.sent !== null);
    const unsaved = readUnsaved();
    let resend = null; // a step chosen before a reload of this page, not yet the server's
    if (unsaved && this.keyTimer === null && this.sent === null) {
      const saved = unsaved.budget === data.budgets[data.active];
      const fits = unsaved.front_id === data.front_id && data.removed[unsaved.step] === unsaved.removed;
      if (!saved && fits && !previous) {
        resend = unsaved.step;
        this.wanted = resend;
        keep = true;
      } else if (saved || !fits) {
        writeUnsaved(null);
      }
    }
    slider.min = String(data.budgets[0] * 100);
    slider.max = String(data.budgets[data.budgets.length - 1] * 100);
    frontCaption.textContent = `Predicted ${data.objective} increase vs budget (nats/token)`;
    drawLegend(legend, data.legend);
    if (this.sent === null && this.keyTimer === null) { // nothing of the user's is on its way
      status.textContent = "";
      this.ui.root.classList.remove("gap-budget-pending");
    }
    if (!previous || previous.rates_figure !== data.rates_figure) {
      const fig = JSON.parse(data.rates_figure);
      await Plotly.react(rates, fig.data, fig.layout, PLOT_CONFIG);
    }
    if (!previous || previous.front_figure !== data.front_figure) {
      const fig = JSON.parse(data.front_figure);
      await Plotly.react(front, fig.data, fig.layout, PLOT_CONFIG);
      this.measureFront();
      if (!front.__gapDotHook) {
        // Resizes and redraws move the plot area: measured again, then the point follows.
        front.on("plotly_afterplot", () => { this.measureFront(); this.placeDot(); });
        front.__gapDotHook = true;
      }
    }
    this.ui.dot.style.setProperty("--dot", data.marker_color);
    this.shown = null; // the figures were built at the active step; the readout is not yet
    this.request(keep ? this.wanted : data.active);
    if (resend !== null) {
      this.ui.slider.value = String(data.budgets[resend] * 100);
      this.release();
    }
  }

  request(step) {
    this.wanted = step;
    if (!this.busy) this.pump();
  }

  async pump() {
    this.busy = true;
    try {
      while (this.wanted !== this.shown) {
        const step = this.wanted;
        const started = performance.now();
        await this.draw(step);
        this.shown = step;
        this.ui.root.dispatchEvent(new CustomEvent("gap-budget-drawn", { detail: { step, started } }));
      }
    } finally {
      this.busy = false;
    }
  }

  async draw(step) {
    const d = this.data;
    const { slider, value, removed, left, loss, rates, front } = this.ui;
    const budget = d.budgets[step];
    const net = d.removed[step]; // a charged front's removal is net of the biases compensation adds
    const biases = d.bias ? d.bias[step] : 0;
    const kept = d.dense_total - net; // what the pruned model has, its biases included
    if (!this.dragging) slider.value = String(budget * 100);
    slider.setAttribute("aria-valuetext", `${(budget * 100).toFixed(2)}% of prunable parameters`);
    value.textContent = `${(budget * 100).toFixed(2)}%`;
    removed.textContent = `removes ${formatCount(net + biases)} parameters`
      + (biases ? `, adds ${formatCount(biases)} biases` : "")
      + ` (${((100 * net) / d.dense_total).toFixed(1)}% of all${biases ? ", net" : ""})`;
    left.textContent = `${formatCount(kept)} left · ${Math.round((kept * 4) / 2 ** 20)} MiB fp32`;
    loss.textContent = `predicted ${d.objective} +${d.loss[step].toFixed(4)} nats/token`;
    if (!this.ui.root.classList.contains("gap-budget-pending")) {
      this.ui.status.textContent = this.dragging && step !== d.active ? "release to use this budget" : "";
    }
    this.ui.readout.dataset.step = String(step); // on the readout: an attribute change on the root
    this.ui.readout.dataset.row = String(d.rows[step]); // would restyle the whole chart
    // The bars show what each rate really removes (attention rounds to whole GQA shapes), looked
    // up per grid rate and layer; the hover says which heads and channels stay.
    const bars = (indices, share, text) => (share
      ? { y: indices.map((k, layer) => share[k][layer]), customdata: indices.map((k, layer) => text[k][layer]) }
      : { y: indices.map((k) => d.grid[k]) });
    this.point = [budget * 100, d.loss[step]];
    this.placeDot();
    const ignoreInterrupted = () => {}; // a newer step replaced this one
    const data = [bars(d.attn[step], d.attn_share, d.attn_text), bars(d.mlp[step], d.mlp_share, d.mlp_text), { y: [budget, budget] }];
    await window.Plotly.animate(rates, { data, traces: [0, 1, 2] }, NO_REDRAW).catch(ignoreInterrupted);
  }

  // The front's plot area inside the chart's area and its axes' ranges, through plotly.js's public
  // surface only: the figure's own layout (both ranges are set, linear) and the drag rectangle
  // plotly.js lays over the plot area (.nsewdrag), measured in the DOM. Done once per redraw,
  // so a step of the slider costs two divisions, not a layout read.
  measureFront() {
    const gd = this.ui.front;
    const drag = gd.querySelector(".nsewdrag");
    const x = gd.layout && gd.layout.xaxis && gd.layout.xaxis.range;
    const y = gd.layout && gd.layout.yaxis && gd.layout.yaxis.range;
    const box = drag && drag.getBoundingClientRect();
    if (!box || !box.width || !box.height || !x || !y) { this.frontBox = null; return; } // not displayed
    const origin = gd.parentElement.getBoundingClientRect(); // the area the dot is positioned in
    this.frontBox = {
      left: box.left - origin.left, top: box.top - origin.top, width: box.width, height: box.height,
      x0: Number(x[0]), x1: Number(x[1]), y0: Number(y[0]), y1: Number(y[1]),
    };
  }

  placeDot() {
    const b = this.frontBox;
    if (!b || !this.point) return;
    const x = b.left + ((this.point[0] - b.x0) / (b.x1 - b.x0)) * b.width;
    const y = b.top + ((b.y1 - this.point[1]) / (b.y1 - b.y0)) * b.height; // pixels grow downwards
    this.ui.dot.style.transform = `translate(${x}px, ${y}px) translate(-50%, -50%)`; // centred, whatever its box sizing
    this.ui.dot.dataset.x = String(this.point[0]);
    this.ui.dot.dataset.y = String(this.point[1]);
  }

  endDrag() {
    if (!this.dragging) return;
    this.dragging = false;
    this.applyDeferred();
  }

  applyDeferred() {
    if (!this.deferred) return;
    const next = this.deferred;
    this.deferred = null;
    this.update(next);
  }

  key(event) {
    if (!this.data) return;
    const moves = { ArrowLeft: -1, ArrowDown: -1, ArrowRight: 1, ArrowUp: 1, PageDown: -10, PageUp: 10 };
    const last = this.data.budgets.length - 1;
    let step = this.wanted ?? this.data.active;
    if (event.key in moves) step = Math.min(last, Math.max(0, step + moves[event.key]));
    else if (event.key === "Home") step = 0;
    else if (event.key === "End") step = last;
    else return;
    event.preventDefault();
    this.request(step);
    this.ui.slider.value = String(this.data.budgets[step] * 100);
    writeUnsaved({ ...this.payload(step), id: stepId() });
    clearTimeout(this.keyTimer);
    this.keyTimer = setTimeout(() => {
      this.keyTimer = null;
      this.release();
    }, KEY_RELEASE_MS);
    this.ui.root.classList.add("gap-budget-pending"); // the page's plan is not this step's yet
    this.ui.status.textContent = "setting the budget…";
  }

  payload(step) {
    const d = this.data;
    return { front_id: d.front_id, step, row: d.rows[step], removed: d.removed[step], budget: d.budgets[step] };
  }

  release() {
    this.dragging = false;
    const d = this.data;
    const step = nearestStep(d.budgets, Number(this.ui.slider.value));
    this.request(step);
    this.ui.slider.value = String(d.budgets[step] * 100); // the thumb sits on the row's own budget
    if (step === (this.sent ?? d.active)) { // what the server has, or will have once the release in flight lands
      if (this.sent === null) { // back at the server's step: nothing to send
        this.ui.root.classList.remove("gap-budget-pending");
        this.ui.status.textContent = "";
        writeUnsaved(null);
      }
      this.applyDeferred(); // data that arrived during the drag
      return;
    }
    this.ui.root.classList.add("gap-budget-pending");
    this.ui.status.textContent = "setting the budget…";
    this.sent = step;
    this.deferred = null; // the rerun that follows brings fresh data
    writeUnsaved({ ...this.payload(step), id: stepId() });
    this.setTriggerValue("release", this.payload(step));
  }
}

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  let chart = parentElement.__gapBudgetChart;
  if (!chart) {
    chart = new BudgetChart(parentElement, setTriggerValue);
    parentElement.__gapBudgetChart = chart;
  }
  chart.setTriggerValue = setTriggerValue;
  chart.update(data).catch((error) => {
    chart.ui.status.textContent = `The chart could not be drawn: ${error.message}`;
  });
  // Streamlit also runs a stale call's cleanup when data changes quickly; act on unmount only.
  return () => {
    setTimeout(() => {
      if (parentElement.isConnected) return;
      // Left the planner with keys not yet sent: the keeper on the next page sends them (a
      // trigger from this unmounted chart would rerun the page the user left).
      clearTimeout(chart.keyTimer);
      chart.resizeObserver.disconnect();
      window.removeEventListener("pointerup", chart.onPointerUp);
      delete parentElement.__gapBudgetChart;
    }, 0);
  };
}
