// What this browser receives, measured in the page: video frames presented per second
// (requestVideoFrameCallback) and the audio level (a WebAudio analyser on the remote audio track).

const WINDOW_MS = 2000;

/** Frames presented by a <video> element per second, over the last two seconds. */
export class FrameCounter {
  presented = 0;
  private samples: Array<[number, number]> = []; // (now ms, presentedFrames)
  private handle = 0;
  private running = false;

  constructor(private readonly video: HTMLVideoElement) {}

  start(): void {
    if (this.running) return;
    this.running = true;
    const tick = (now: DOMHighResTimeStamp, meta: VideoFrameCallbackMetadata) => {
      if (!this.running) return;
      this.presented = meta.presentedFrames;
      this.samples.push([now, meta.presentedFrames]);
      while (this.samples.length > 2 && now - this.samples[0][0] > WINDOW_MS) this.samples.shift();
      this.handle = this.video.requestVideoFrameCallback(tick);
    };
    this.handle = this.video.requestVideoFrameCallback(tick);
  }

  stop(): void {
    this.running = false;
    this.video.cancelVideoFrameCallback(this.handle);
    this.samples = [];
  }

  /** Frames per second over the window (0 until two callbacks; stale after 1 s without frames). */
  fps(now = performance.now()): number {
    const s = this.samples;
    if (s.length < 2 || now - s[s.length - 1][0] > 1000) return 0;
    const [t0, f0] = s[0];
    const [t1, f1] = s[s.length - 1];
    return t1 > t0 ? ((f1 - f0) * 1000) / (t1 - t0) : 0;
  }
}

/** RMS level (dBFS) of a remote audio track, sampled every 50 ms; `peakDb` is the loudest since `resetPeak`. */
export class AudioLevel {
  levelDb = -100;
  peakDb = -100;
  private ctx: AudioContext | null = null;
  private timer = 0;

  start(track: MediaStreamTrack): void {
    this.stop();
    const ctx = (this.ctx = new AudioContext());
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 1024;
    ctx.createMediaStreamSource(new MediaStream([track])).connect(analyser);
    const buf = new Float32Array(analyser.fftSize);
    void ctx.resume();
    this.timer = window.setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0;
      for (const x of buf) sum += x * x;
      this.levelDb = Math.max(-100, 10 * Math.log10(sum / buf.length + 1e-12));
      this.peakDb = Math.max(this.peakDb, this.levelDb);
    }, 50);
  }

  resetPeak(): void {
    this.peakDb = -100;
  }

  stop(): void {
    window.clearInterval(this.timer);
    void this.ctx?.close();
    this.ctx = null;
    this.levelDb = this.peakDb = -100;
  }
}

/** Packets the receiver of a remote track has received (RTCInboundRtpStreamStats), or null if unknown. */
export async function packetsReceived(receiver: RTCRtpReceiver | undefined): Promise<number | null> {
  if (!receiver) return null;
  let packets: number | null = null;
  (await receiver.getStats()).forEach((v: RTCStats) => {
    if (v.type === "inbound-rtp") packets = (v as RTCInboundRtpStreamStats).packetsReceived ?? packets;
  });
  return packets;
}
