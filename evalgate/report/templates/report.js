// Filters rows rendered once (toggling `hidden`) and builds an item's diff from the embedded JSON when
// its row is first opened, so pages with thousands of flips stay fast.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("flip-data").textContent);
  var rows = Array.prototype.slice.call(document.querySelectorAll("details.flip"));
  var q = document.getElementById("q");
  if (!q) return;
  var fDir = document.getElementById("f-direction"), fTask = document.getElementById("f-task");
  var fFail = document.getElementById("f-failure"), count = document.getElementById("count");

  function segText(segs) { return segs.map(function (s) { return s[0]; }).join(""); }
  var hay = rows.map(function (row, i) {
    var d = data[i];
    return [row.dataset.task, row.querySelector("summary").textContent, d.question || "", d.gold || "",
            segText(d.base.segments), segText(d.cand.segments), d.base.failure_class || "", d.cand.failure_class || ""]
      .join("\n").toLowerCase();
  });

  function apply() {
    var t0 = performance.now();
    var text = q.value.trim().toLowerCase(), dir = fDir.value, task = fTask.value, fail = fFail.value, shown = 0;
    for (var i = 0; i < rows.length; i++) {
      var d = data[i], row = rows[i];
      var ok = (!dir || row.dataset.direction === dir) && (!task || row.dataset.task === task) &&
               (!fail || d.base.failure_class === fail || d.cand.failure_class === fail) &&
               (!text || hay[i].indexOf(text) !== -1);
      if (row.hidden === ok) row.hidden = !ok;
      if (ok) shown++;
    }
    count.textContent = shown + " of " + rows.length;
    window.evalgateLastFilterMs = performance.now() - t0;
  }
  var timer = null;
  q.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(apply, 120); });
  [fDir, fTask, fFail].forEach(function (el) { el.addEventListener("change", apply); });
  window.evalgateApplyFilter = apply;

  // Sorting moves the rendered rows (filters and opened diffs stay as they are); a second click on the same
  // column reverses it. Rows without a value (a flip not explained, no margin) stay last either way.
  var list = document.getElementById("flip-list"), sortedBy = null, order = 1;
  var KIND_RANK = {"divergence": 0, "near-tie": 1, "same tokens": 2, "not replayed": 3};
  function value(row, key) {
    var v = row.dataset[key];
    if (v === undefined || v === "") return null;
    if (key === "margin") return Number(v);
    if (key === "kind") return v in KIND_RANK ? KIND_RANK[v] : 9;
    return v;
  }
  function compare(a, b, key) {
    var x = value(a, key), y = value(b, key);
    if (x === null || y === null) return x === y ? 0 : x === null ? 1 : -1;
    var c = typeof x === "number" ? x - y : String(x).localeCompare(String(y), undefined, {numeric: true});
    return c * order;
  }
  function sortBy(key) {
    order = sortedBy === key ? -order : 1;
    sortedBy = key;
    rows.slice().sort(function (a, b) {
      return compare(a, b, key) || Number(a.dataset.i) - Number(b.dataset.i);
    }).forEach(function (row) { list.appendChild(row); });
    Array.prototype.forEach.call(document.querySelectorAll("button.sort"), function (b) {
      if (b.dataset.sort === key) b.setAttribute("aria-sort", order > 0 ? "ascending" : "descending");
      else b.removeAttribute("aria-sort");
    });
  }
  Array.prototype.forEach.call(document.querySelectorAll("button.sort"), function (b) {
    b.addEventListener("click", function () { sortBy(b.dataset.sort); });
  });
  window.evalgateSortBy = sortBy;

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function side(label, s, metric) {
    var box = el("div", "side"), head = el("header");
    head.appendChild(el("b", null, label));
    head.appendChild(document.createTextNode(" · " + metric + " = " + s.score));
    if (s.extracted !== null || !s.failure_class) {
      head.appendChild(document.createTextNode(" · answer "));
      head.appendChild(el("code", null, s.extracted === null ? "—" : s.extracted));
    }
    head.appendChild(document.createTextNode(" · finish " + (s.finish_reason || "—") +
      (s.n_tokens !== null && s.n_tokens !== undefined ? " · " + s.n_tokens + " tokens" : "")));
    if (s.failure_class) { head.appendChild(document.createTextNode(" · ")); head.appendChild(el("b", null, s.failure_class)); }
    box.appendChild(head);
    var pre = el("pre", "completion");
    s.segments.forEach(function (seg) {
      pre.appendChild(seg[1] ? el("span", seg[1], seg[0]) : document.createTextNode(seg[0]));
    });
    box.appendChild(pre);
    if (s.stderr) box.appendChild(el("pre", "stderr", s.stderr));
    return box;
  }
  function render(body, d) {
    if (d.question) body.appendChild(el("div", "question", d.question));
    var gold = el("div", "item-head");
    if (d.gold !== null) {
      gold.appendChild(el("b", null, "gold"));
      gold.appendChild(el("code", null, d.gold));
    }
    if (d.same_text) gold.appendChild(el("span", "muted", "identical completions"));
    body.appendChild(gold);
    if (d.prompt) {
      var p = el("details", "prompt");
      p.appendChild(el("summary", null, "prompt"));
      p.appendChild(el("pre", null, d.prompt));
      body.appendChild(p);
    }
    var sides = el("div", "sides");
    sides.appendChild(side("baseline", d.base, d.metric));
    sides.appendChild(side("candidate", d.cand, d.metric));
    body.appendChild(sides);
  }
  document.addEventListener("toggle", function (ev) {
    var row = ev.target;
    if (!row.classList || !row.classList.contains("flip") || !row.open) return;
    var body = row.querySelector(".body");
    if (!body.firstChild) render(body, data[Number(row.dataset.i)]);
  }, true);
})();
