// What the page keeps, all of it in this browser: conversations and settings in localStorage,
// the API key in sessionStorage only (gone when the tab is closed). The server keeps nothing.

const CHATS = "voltserve.chats";
const SETTINGS = "voltserve.settings";
const KEY = "voltserve.apiKey";
export const THEME = "voltserve.theme"; // read by theme.js before the first paint too

export const DEFAULT_SETTINGS = {
  model: "",
  system: "",
  temperature: "",
  top_p: "",
  max_tokens: "",
  extra: "",
};

function read(storage, name, fallback) {
  try {
    const v = storage.getItem(name);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

// False when the browser refused (storage full or disabled).
function write(storage, name, value) {
  try {
    storage.setItem(name, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

export const loadChats = () => {
  const chats = read(localStorage, CHATS, []);
  return Array.isArray(chats) ? chats.filter((c) => c && Array.isArray(c.messages)) : [];
};
export const saveChats = (chats) => write(localStorage, CHATS, chats);

export const loadSettings = () => ({ ...DEFAULT_SETTINGS, ...read(localStorage, SETTINGS, {}) });
export const saveSettings = (s) => write(localStorage, SETTINGS, s);

export const loadKey = () => read(sessionStorage, KEY, "");
export const saveKey = (key) =>
  key ? write(sessionStorage, KEY, key) : sessionStorage.removeItem(KEY);

export const loadTheme = () => read(localStorage, THEME, "");
export const saveTheme = (t) =>
  t ? write(localStorage, THEME, t) : localStorage.removeItem(THEME);
