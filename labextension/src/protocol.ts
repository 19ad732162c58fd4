/**
 * The messages of the `accelnb.gpus` comm, as the kernel side (`accelnb/notebook/lab_bridge.py`)
 * defines them. That module's docstring is the reference; these types mirror it.
 */

/** The comm target the kernel registers when `%load_ext accelnb` runs. */
export const COMM_TARGET = 'accelnb.gpus';

export interface IGpu {
  index: number;
  name: string;
  uuid: string;
  pci_bus_id: string;
  memory_total: number; // bytes
  memory_used: number; // bytes
  utilization: number | null; // percent
  visible: boolean; // usable under the kernel's CUDA_VISIBLE_DEVICES
  processes: IGpuProcess[];
  // the last minute of utilisation, [seconds ago, percent], oldest first; absent from older kernels
  history?: [number, number][];
  busy?: string; // why a selected GPU is taken by another process, or ""
}

/** A process holding memory on a GPU, as NVML lists it, named from the kernel's /proc. */
export interface IGpuProcess {
  pid: number;
  memory_used: number | null; // bytes
  name?: string; // "python3 train.py"; "" when the pid is not visible to the kernel
  user?: string;
  ours?: boolean; // this kernel or one of its ranks
}

export interface IInventory {
  gpus: IGpu[];
  synthetic: boolean;
  source: string;
  note: string;
}

export interface ISelection {
  gpus: number[] | null;
  num_processes: number | null;
  magic_line: string;
}

export type RankPhase = 'starting' | 'running' | 'done' | 'failed' | 'stopped';

export interface IRank {
  rank: number;
  device: string;
  phase: RankPhase;
  pid: number | null;
  detail: string;
  // its step, steps/s, waiting share, GPU and host memory, one line (RankRow.describe), at most
  // once a second; absent from a kernel older than the live per-rank view
  progress?: string;
  // the same as numbers, once the rank has taken a step
  figures?: IRankFigures;
}

export interface IRankFigures {
  steps: number;
  steps_per_s: number | null;
  gpu_utilization: number | null; // percent
  gpu_memory_used: number | null; // bytes
  gpu_memory_total: number | null;
}

export interface IRun {
  run_id: number;
  finished: boolean;
  // what asked the ranks to stop at their next accelnb.stop_requested() check, while they save;
  // absent from a kernel older than the Stop that saves
  stop_pending?: string | null;
  ranks: IRank[];
}

/** One trial of a sweep (`accelnb.sweep`): its GPUs while it runs. */
export interface ITrial {
  index: number;
  label: string; // its config, short
  gpus: number[];
  state: 'queued' | 'running' | 'done' | 'failed' | 'stopped' | 'skipped';
}

export interface ISweep {
  sweep_id: number;
  finished: boolean;
  trials: ITrial[];
}

/** Kernel → panel. */
export interface IStateMessage {
  type: 'state';
  inventory: IInventory;
  selection: ISelection; // gpus and num_processes both null: nothing chosen yet
  run: IRun | null; // during a sweep: the latest trial to start
  sweep?: ISweep | null; // absent from a kernel older than sweeps
}

export interface IErrorMessage {
  type: 'error';
  message: string;
}

/** Every rank's current Python stack, answering a `stacks` request; nothing was stopped. */
export interface IStacksMessage {
  type: 'stacks';
  taken_at: string; // HH:MM:SS, the kernel's clock
  ranks: { rank: number; stack: string }[];
  error: string; // non-empty: no stacks (no run in progress, or the run ended meanwhile)
}

export type KernelMessage = IStateMessage | IErrorMessage | IStacksMessage;

/** Panel → kernel. */
export type PanelMessage =
  | { type: 'select'; gpus: number[] }
  | { type: 'select'; num_processes: number }
  | { type: 'refresh' }
  | { type: 'watch'; on: boolean } // read the GPUs every 2 s while the panel is shown
  | { type: 'stop' }
  | { type: 'stacks' };
