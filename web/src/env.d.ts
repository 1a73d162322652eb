// Vite's ambient types (CSS imports, import.meta.env) for the page's sources.
/// <reference types="vite/client" />
