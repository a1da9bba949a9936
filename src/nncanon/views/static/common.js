"use strict";
/* Shared helpers of nncanon's views: the embedded data, elements built with textContent only, colour scales. */
const DATA = JSON.parse(document.getElementById("view-data").textContent);
const VIEW = document.getElementById("view");
const TIP = document.getElementById("tip");
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, text, parent) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (parent) parent.appendChild(node);
  return node;
}

function showToken(text) {
  return String(text).replace(/\n/g, "\u23ce").replace(/\t/g, "\u2192").replace(/\r/g, "\u21b5");
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "NaN";
  return Number(value).toPrecision(digits || 3);
}

/* white -> blue, for a value in [0, 1] */
function blues(t) {
  if (t === null || t === undefined || Number.isNaN(t)) return "#eeeeee";
  t = Math.max(0, Math.min(1, t));
  const r = Math.round(255 - 222 * t), g = Math.round(255 - 153 * t), b = Math.round(255 - 75 * t);
  return `rgb(${r},${g},${b})`;
}

/* blue (negative) - white - red (positive), for a value in [-1, 1] */
function redBlue(t) {
  if (t === null || t === undefined || Number.isNaN(t)) return "#eeeeee";
  t = Math.max(-1, Math.min(1, t));
  const a = Math.abs(t);
  if (t >= 0) return `rgb(${Math.round(255 - 77 * a)},${Math.round(255 - 231 * a)},${Math.round(255 - 212 * a)})`;
  return `rgb(${Math.round(255 - 222 * a)},${Math.round(255 - 153 * a)},${Math.round(255 - 75 * a)})`;
}

function textOn(t) { return Math.abs(t || 0) > 0.6 ? "#fff" : "#1d2230"; }

function tip(event, text) {
  if (text === null) { TIP.hidden = true; return; }
  TIP.textContent = text;
  TIP.hidden = false;
  TIP.style.left = Math.min(event.clientX + 12, window.innerWidth - 300) + "px";
  TIP.style.top = (event.clientY + 12) + "px";
}

function missing(text, parent) { return el("div", {class: "missing"}, text, parent || VIEW); }

function ready() {
  document.body.dataset.ready = "1";
  window.viewReady = performance.now();
}
