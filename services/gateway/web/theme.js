// Loaded before the first paint: the light or dark theme chosen in the page (store.js), else
// the system's (chat.css follows prefers-color-scheme).
try {
  const t = JSON.parse(localStorage.getItem("voltserve.theme") ?? '""');
  if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;
} catch {
  // storage disabled: the system's theme
}
