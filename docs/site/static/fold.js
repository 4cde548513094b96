// The course's website: a lesson's "Going deeper" part starts folded, as a detour the reader opens on purpose.
// build.py puts a marker under its heading (both languages); everything in that section after the heading moves
// into a <details> element, closed.
document.addEventListener("DOMContentLoaded", () => {
  const marker = document.querySelector(".going-deeper-marker");
  const section = marker && marker.closest("section");
  if (!section) return;
  const heading = section.querySelector("h2");
  const details = document.createElement("details");
  details.className = "going-deeper";
  const summary = document.createElement("summary");
  summary.textContent = document.documentElement.lang.startsWith("zh")
    ? "展开：不在主线上的内容" : "Open: what the lesson's spine does not need";
  details.appendChild(summary);
  for (const node of [...section.childNodes]) {
    if (node !== heading) details.appendChild(node);
  }
  section.appendChild(details);
});
