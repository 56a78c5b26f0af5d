// The service's HTTP API as the watch page uses it (deployments/api/http.py, deployments/api/watch.py).

export interface Stats {
  chunks: number;
  frames: number;
  fps: number; // generated: new frames per second (held repeats of a late chunk do not count)
  presentedFps?: number; // what the playout showed, held repeats included
  speechMsP50?: number; // agent speech -> its first frame shown, median over the session's utterances
  lateChunks: number;
  stepMsP50: number;
  stepMsP95: number;
  audioQueuedS: number;
  bufferMs?: number;
  avOffsetMs?: number;
  stageMs?: Record<string, number>;
}

export interface Session {
  id: string;
  status: "QUEUED" | "STARTING" | "READY" | "RUNNING" | "ENDED" | "FAILED";
  reason: string | null;
  queuePosition: number | null;
  stats: Stats;
}

export interface WatchConfig {
  livekit: boolean;
  url: string | null;
  preset: string;
  width: number;
  height: number;
  fps: number;
  maxDuration: number;
}

export interface Viewer {
  url: string;
  roomName: string;
  identity: string;
  token: string;
}

/** A refusal of the API: its HTTP status, machine-readable code, message and Retry-After (seconds). */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly field: string | null = null,
    readonly retryAfterS: number | null = null,
  ) {
    super(message);
  }

  /** What to tell the person, in words. */
  explain(): string {
    if (this.status === 503 && this.retryAfterS !== null) {
      return `The service has no free capacity right now: try again in ${this.retryAfterS} s. (${this.message})`;
    }
    if (this.status === 429 && this.retryAfterS !== null) {
      return `Your API key has reached its limit of live sessions: end one, or retry in ${this.retryAfterS} s. ` +
        `(${this.message})`;
    }
    if (this.status === 401) return `The service needs an API key: enter it in "API key" and try again. (${this.message})`;
    const where = this.field ? `${this.field}: ` : "";
    return `The service refused (${this.status} ${this.code}): ${where}${this.message}`;
  }
}

export class Api {
  apiKey = "";

  private headers(extra: Record<string, string> = {}): Record<string, string> {
    return this.apiKey ? { ...extra, Authorization: `Bearer ${this.apiKey}` } : extra;
  }

  private async call<T>(method: string, path: string, body?: BodyInit, type = "application/json"): Promise<T> {
    let resp: Response;
    try {
      resp = await fetch(path, { method, body, headers: this.headers(body === undefined ? {} : { "Content-Type": type }) });
    } catch (e) {
      throw new ApiError(0, "unreachable", `the service at ${location.origin} did not answer (${String(e)})`);
    }
    if (resp.status === 204) return undefined as T;
    const text = await resp.text();
    let data: unknown = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!resp.ok) {
      const err = (data as { error?: { code?: string; message?: string; field?: string | null } } | null)?.error;
      const retry = resp.headers.get("Retry-After");
      throw new ApiError(resp.status, err?.code ?? "http_error", err?.message ?? (text.slice(0, 200) || resp.statusText),
        err?.field ?? null, retry === null ? null : Number(retry));
    }
    return data as T;
  }

  config(): Promise<WatchConfig> {
    return this.call("GET", "/v1/watch/config");
  }

  start(image: string, maxDuration: number): Promise<{ session: Session; viewer: Viewer }> {
    return this.call("POST", "/v1/watch/sessions", JSON.stringify({ avatar: { image }, maxDuration }));
  }

  session(id: string): Promise<Session> {
    return this.call("GET", `/v1/sessions/${encodeURIComponent(id)}`);
  }

  end(id: string): Promise<Session> {
    return this.call("DELETE", `/v1/sessions/${encodeURIComponent(id)}`);
  }

  speak(id: string, wav: Blob): Promise<void> {
    return this.call("POST", `/v1/sessions/${encodeURIComponent(id)}/audio`, wav, "audio/wav");
  }

  interrupt(id: string): Promise<void> {
    return this.call("DELETE", `/v1/sessions/${encodeURIComponent(id)}/audio`);
  }

  /** Best effort when the page goes away (the room emptying ends the session too). */
  endOnUnload(id: string): void {
    void fetch(`/v1/sessions/${encodeURIComponent(id)}`, { method: "DELETE", keepalive: true, headers: this.headers() })
      .catch(() => undefined);
  }
}
